"""Prompt data: JSONL records (validation, file:line errors, skip and count),
the grain stream (seeded order, per-host shards, epochs, exact resume) and the
shipped sample files."""

import json
import os

import pytest

from arl_jax.envs import jsonl_source, prompt_data, prompt_source, sample_data


def _write(tmp_path, lines, name="p.jsonl"):
  path = tmp_path / name
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def test_valid_records_load_with_stable_ids(tmp_path):
  path = _write(tmp_path, [
      json.dumps({"prompt": "1+1=", "answer": "2", "env": "arith", "id": 7}),
      "",  # blank lines are ignored
      json.dumps({"prompt": "2+2=", "answer": 4}),
      json.dumps({"prompt": "3+3=", "answer": "6", "id": "three"}),
  ])
  loaded = jsonl_source.load(path, env_name="arith")
  assert [p.prompt_id for p in loaded.prompts][:2] == [7, 1]  # id, else position
  assert loaded.prompts[1].answer == "4"  # numbers become strings
  # A string id is a stable 63-bit hash.
  assert 0 <= loaded.prompts[2].prompt_id < 2 ** 63
  assert loaded.prompts[2].prompt_id == jsonl_source._string_id("three")  # noqa: SLF001
  assert loaded.skipped == []


@pytest.mark.parametrize("line, problem", [
    ("{not json", "Expecting property name"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({"answer": "2"}), "field 'prompt' must be a non-empty string"),
    (json.dumps({"prompt": "", "answer": "2"}), "field 'prompt' must be a non-empty string"),
    (json.dumps({"prompt": "q", "answer": ""}), "field 'answer' must be a non-empty"),
    (json.dumps({"prompt": "q", "answer": True}), "field 'answer' must be a non-empty"),
    (json.dumps({"prompt": "q", "answer": "1", "env": "chess"}), "record is for env 'chess'"),
    (json.dumps({"prompt": "q", "answer": "1", "solution": "x"}), r"unknown field\(s\) \['solution'\]"),
    (json.dumps({"prompt": "q", "answer": "1", "id": 1.5}), "field 'id' must be an int"),
])
def test_a_malformed_line_is_named_by_file_and_line(tmp_path, line, problem):
  good = json.dumps({"prompt": "1+1=", "answer": "2"})
  path = _write(tmp_path, [good, good.replace("1+1", "2+2"), line, good.replace("1+1", "3+3")])
  with pytest.raises(jsonl_source.MalformedRecord, match=rf"p.jsonl:3: .*{problem}"):
    jsonl_source.load(path, env_name="arith")
  loaded = jsonl_source.load(path, env_name="arith", on_malformed="skip")
  assert len(loaded.prompts) == 3 and len(loaded.skipped) == 1
  assert loaded.skipped[0].startswith(f"{path}:3: ")


def test_duplicate_ids_name_both_lines_and_can_be_skipped(tmp_path):
  path = _write(tmp_path, [json.dumps({"prompt": "a", "answer": "1", "id": 3})] * 2 + [
      json.dumps({"prompt": "b", "answer": "2"}),  # implicit id 2 (its position) ...
      json.dumps({"prompt": "c", "answer": "3", "id": 2})])  # ... taken by an explicit one
  with pytest.raises(jsonl_source.MalformedRecord,
                     match=r"p.jsonl:2: prompt id 3 was already used at .*p.jsonl:1"):
    jsonl_source.load(path)
  loaded = jsonl_source.load(path, on_malformed="skip")
  assert [p.text for p in loaded.prompts] == ["a", "b"]
  assert [s.split(": ")[0].rsplit(":", 1)[1] for s in loaded.skipped] == ["2", "4"]


def test_invalid_utf8_is_named_by_file_and_line(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
  with pytest.raises(jsonl_source.MalformedRecord, match=r"p.jsonl:2: .*utf-8"):
    jsonl_source.load(str(path))


def test_same_seed_same_order_and_a_new_permutation_every_epoch():
  prompts = list(range(50))
  first = list(prompt_data.prompt_dataset(prompts, seed=3, num_epochs=2))
  assert first == list(prompt_data.prompt_dataset(prompts, seed=3, num_epochs=2))
  assert first != list(prompt_data.prompt_dataset(prompts, seed=4, num_epochs=2))
  assert sorted(first[:50]) == sorted(first[50:]) == prompts  # each epoch sees every prompt
  assert first[:50] != first[50:]


def test_hosts_get_disjoint_shards_that_cover_the_data():
  prompts = list(range(30))
  shards = [set(prompt_data.prompt_dataset(prompts, 0, shard_index=i, shard_count=3,
                                           num_epochs=1)) for i in range(3)]
  assert set().union(*shards) == set(prompts)
  assert sum(len(s) for s in shards) == 30
  with pytest.raises(ValueError, match="shard_index 3"):
    prompt_data.prompt_dataset(prompts, 0, shard_index=3, shard_count=3)


def test_restoring_the_iterator_state_continues_exactly():
  prompts = list(range(17))
  it = prompt_data.prompt_iterator(prompts, seed=5)
  for _ in range(23):  # into the second epoch
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(20)]
  restored = prompt_data.prompt_iterator(prompts, seed=5)
  restored.set_state(state)
  assert [next(restored) for _ in range(20)] == expected


def test_shipped_sample_files_are_what_the_script_writes():
  for name, records in sample_data.files().items():
    path = os.path.join(sample_data.DATA_DIR, name)
    with open(path, encoding="utf-8") as f:
      assert f.read() == sample_data.render(records), f"{name}: run python -m arl_jax.envs.sample_data"
    env = records[0]["env"]
    assert len(jsonl_source.load(path, env_name=env).prompts) == len(records)


def test_prompt_source_reads_jsonl_or_the_environment(tmp_path):
  from arl_jax.envs import arith
  cfg = arith.ArithConfig(max_operand=9)
  own = prompt_source.load("arith", cfg, prompt_source.DataConfig(), "train")
  assert own.prompts == arith.make_prompts(cfg, "train")
  path = os.path.join(sample_data.DATA_DIR, "arith.jsonl")
  data = prompt_source.DataConfig(train_path=f"{path}, {path}")
  with pytest.raises(jsonl_source.MalformedRecord, match="was already used at"):
    prompt_source.load("arith", cfg, data, "train")
  data = prompt_source.DataConfig(train_path=path)
  assert len(prompt_source.load("arith", cfg, data, "train").prompts) == 200
  # The held-out split still comes from the environment.
  assert prompt_source.load("arith", cfg, data, "heldout").prompts == arith.make_prompts(
      cfg, "heldout")


def test_array_record_files_hold_the_same_records(tmp_path):
  from array_record.python import array_record_module
  path = str(tmp_path / "prompts.array_record")
  writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
  for record in ({"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "id": 9}):
    writer.write(json.dumps(record).encode())
  writer.write(b"\xff not json")
  writer.close()
  with pytest.raises(jsonl_source.MalformedRecord, match=r"prompts.array_record:record 3: "):
    jsonl_source.load(path)
  loaded = jsonl_source.load(path, on_malformed="skip")
  assert [(p.prompt_id, p.text) for p in loaded.prompts] == [(0, "1+1="), (9, "2+2=")]
  assert len(loaded.skipped) == 1


def test_an_environment_checks_its_records_by_file_and_line(tmp_path):
  from arl_jax.envs import arith, mixture
  path = _write(tmp_path, [json.dumps({"prompt": "1+1=", "answer": "2"}),
                           json.dumps({"prompt": "1+2=", "answer": "abc"}),
                           json.dumps({"prompt": "1+3=", "answer": 4})])
  cfg = arith.ArithConfig(max_operand=9)
  data = prompt_source.DataConfig(train_path=path)
  with pytest.raises(jsonl_source.MalformedRecord,
                     match=r"p.jsonl:2: field 'answer' must be an integer for env 'arith', "
                           r"got 'abc'"):
    prompt_source.load("arith", cfg, data, "train")
  data = prompt_source.DataConfig(train_path=path, on_malformed="skip")
  loaded = prompt_source.load("arith", cfg, data, "train")
  assert [p.answer for p in loaded.prompts] == ["2", "4"]
  assert loaded.skipped == [f"{path}:2: field 'answer' must be an integer for env 'arith', "
                            "got 'abc'"]
  # In a mixture, a record is checked by the environment it names.
  mixed = _write(tmp_path, [json.dumps({"prompt": "1+2=", "answer": "abc", "env": "arith"}),
                            json.dumps({"prompt": "k3?", "answer": "abc", "env": "tool_agent"})],
                 name="mixed.jsonl")
  mixture_cfg = mixture.MixtureConfig(components=dict(arith=dict(weight=1.0),
                                                      tool_agent=dict(weight=1.0)))
  loaded = prompt_source.load("mixture", mixture_cfg, prompt_source.DataConfig(
      train_path=mixed, on_malformed="skip"), "train")
  assert [p.env for p in loaded.prompts] == ["tool_agent"]
  assert loaded.skipped[0].startswith(f"{mixed}:1: field 'answer' must be an integer")


def test_prompts_too_long_are_named_or_skipped_on_every_load(tmp_path):
  from arl_jax.envs import arith
  path = _write(tmp_path, [json.dumps({"prompt": "1+1=", "answer": "2"}),
                           json.dumps({"prompt": "12345+67890=", "answer": "80235"}),
                           json.dumps({"prompt": "2+2=", "answer": "4"}),
                           json.dumps({"prompt": "99999+1=", "answer": "100000"})])
  cfg = arith.ArithConfig(max_operand=9)
  data = prompt_source.DataConfig(train_path=path)
  loaded = prompt_source.load("arith", cfg, data, "train")
  assert loaded.wheres == [f"{path}:{i}" for i in (1, 2, 3, 4)]
  def len_fn(prompt):
    return len(prompt.text)

  with pytest.raises(jsonl_source.MalformedRecord,
                     match=r"p.jsonl:2: prompt has 12 tokens, more than sampler.prompt_len=7; "
                           r"1 more line\(s\) too long"):
    prompt_source.drop_long_prompts(data, loaded, len_fn, 7)
  data = prompt_source.DataConfig(train_path=path, on_malformed="skip")
  loaded = prompt_source.load("arith", cfg, data, "train")
  data, kept = prompt_source.drop_long_prompts(data, loaded, len_fn, 8)
  expected = [f"{path}:2: prompt has 12 tokens, more than sampler.prompt_len=8"]
  assert [p.text for p in kept.prompts] == ["1+1=", "2+2=", "99999+1="] and kept.skipped == expected
  # Every later load of this data config (the run's) skips the same line;
  # ids stay those of the lines' positions.
  again = prompt_source.load("arith", cfg, data, "train")
  assert again.prompts == kept.prompts and again.skipped == expected
  assert [p.prompt_id for p in again.prompts] == [0, 2, 3]
  # The environment's own prompts are not this function's to judge.
  own = prompt_source.load("arith", cfg, prompt_source.DataConfig(), "train")
  assert prompt_source.drop_long_prompts(prompt_source.DataConfig(), own, len_fn, 1)[1] is own
