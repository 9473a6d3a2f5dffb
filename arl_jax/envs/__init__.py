"""Environments: the API (`env_api.Environment`) and the registry by name
(`registry`), the built-in tasks (`arith`, `math_answer`, `tool_agent`,
`reasoning_gym`, `humaneval` with `code_tests`, `skyrl_gym`, their `mixture`),
tokenizers and chat templates, prompt records (JSONL, ArrayRecord) and grain
prompt streams. Plain Python: no JAX.

Layer 1: may import `core` and `sandbox` only.
"""
