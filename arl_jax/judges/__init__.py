"""Rewards from a model: a judge asked a templated question about each
completion, its answer turned into a number (`judge_config.JudgeConfig`, the
`judge` section), a frozen Hugging Face model here (`model_judge.py`,
batched on a device), a sequence-classification reward model
(`reward_model.py`) or any OpenAI-compatible server (`openai_judge.py`),
combined with the environment's own reward (`judged_env.py`).

Layer 3: may import `core`, `envs`, `models` and `sharding`.
"""
