"""Hugging Face Jinja chat templates of real models, for tests (no download)."""

# SmolLM2-135M-Instruct's template: ChatML with a default system turn. Its BOS
# token is `<|im_start|>`, which the template writes and the tokenizer never adds.
SMOLLM2_JINJA = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")

# ChatML behind the model's BOS token, as Llama 3's template opens with
# `{{ bos_token }}` (a tokenizer that also adds BOS to plain text must not add
# a second one to a rendered prompt).
BOS_CHATML = ("{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] "
              "+ '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
