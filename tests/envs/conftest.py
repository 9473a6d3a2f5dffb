"""A small BPE `tokenizer.json` built here (no download), for tokenizer tests."""

import pytest

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = ["Ann has 12 apples and gets 7 more.", "How many apples now? #### 19",
            "user assistant system tool"] * 20
  tok.train_from_iterator(corpus, trainer)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


