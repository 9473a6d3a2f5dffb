"""A small chat tokenizer folder written here (no download): a byte-level BPE
`tokenizer.json` and a `tokenizer_config.json` whose Jinja chat template is
Qwen2.5's (tools in the system turn, `<tool_call>` JSON in assistant turns,
tool results as `<tool_response>` in user turns). The gateway's tests and
benchmarks serve a tiny model with it."""

from __future__ import annotations

import json
import os

# Qwen2.5-Instruct's chat template (tokenizer_config.json), with its default
# system prompt shortened.
QWEN25_JINJA = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")

_CORPUS = ["What is the weather in Paris? It is sunny and 21 degrees.",
           '{"name": "get_weather", "arguments": {"city": "Paris"}}',
           "user assistant system tool <tool_response> </tool_response> You are a helpful "
           "assistant. # Tools function signatures json object name arguments",
           "Add 12 and 7. The sum is 19. 0 1 2 3 4 5 6 7 8 9",
           # (the tool preamble, so that a prompt with tools stays short)
           "You may call one or more functions to assist with the user query. You are provided "
           "with function signatures within <tools></tools> XML tags: For each function call, "
           'return a json object with function name and arguments within XML tags: {"type": '
           '"function", "function": {"name": "description": "The weather in a city.", '
           '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
           '"required": ["city"]}}} <function-name>, <args-json-object>}']


def write_chat_folder(folder: str, vocab_size: int = 512) -> str:
  """Writes `tokenizer.json` and `tokenizer_config.json` (Qwen2.5's template,
  EOS `<|im_end|>`, no BOS) to `folder`; returns it."""
  import tokenizers  # noqa: PLC0415 - the [hf] extra
  from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

  tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_CORPUS * 20, trainer)
  os.makedirs(folder, exist_ok=True)
  tok.save(os.path.join(folder, "tokenizer.json"))
  config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
            "chat_template": QWEN25_JINJA, "model_max_length": 4096}
  with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  return folder
