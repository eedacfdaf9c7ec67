"""Several models on one machine (issue 34): the split of workers, CPUs and KV, and the flags that ask for it."""

from __future__ import annotations

import pytest

from tokenline.engine.config import MiB
from tokenline.engine.machine import GiB, Machine, plan_workers
from tokenline.engine.model_plan import ModelAsk, describe_models, plan_models
from tokenline.server.model_flags import ModelFlag, model_flags

BOX = Machine(cpus=4, available_bytes=24 * GiB, cpu_ids=(0, 1, 2, 3))


def test_one_model_is_planned_as_before():
    assert plan_models(BOX, [ModelAsk("m", 1024)]) == [plan_workers(BOX, kv_bytes_per_token=1024)]


def test_models_without_counts_share_the_machines_workers_evenly_and_each_gets_one_at_least():
    assert [p.workers for p in plan_models(BOX, [ModelAsk("a"), ModelAsk("b")])] == [2, 2]
    assert [p.workers for p in plan_models(BOX, [ModelAsk("a"), ModelAsk("b"), ModelAsk("c")])] == [2, 1, 1]
    assert [p.workers for p in plan_models(BOX, [ModelAsk(n) for n in "abcdef"])] == [1] * 6  # more models than CPUs
    assert [p.workers for p in plan_models(BOX, [ModelAsk("a"), ModelAsk("b")], workers=6)] == [3, 3]


def test_a_model_given_its_own_count_keeps_it_and_the_others_share_the_rest():
    plans = plan_models(BOX, [ModelAsk("big", workers=3), ModelAsk("small")])
    assert [p.workers for p in plans] == [3, 1]
    assert [p.workers for p in plan_models(BOX, [ModelAsk("a", workers=1), ModelAsk("b", workers=1)])] == [1, 1]


def test_every_worker_gets_the_same_kv_share_capped_by_what_its_own_model_can_use():
    plans = plan_models(BOX, [ModelAsk("large", kv_bytes_per_token=64 * 1024), ModelAsk("tiny", kv_bytes_per_token=1024)],
                        max_seqs=8, max_model_len=1024)
    one = plan_workers(BOX, workers=4)  # four worker processes, whatever model they run
    assert plans[0].kv_cache_bytes == min(one.kv_cache_bytes, 64 * 1024 * 8 * 1024)
    assert plans[1].kv_cache_bytes == max(1024 * 8 * 1024 // MiB * MiB, 64 * MiB)  # the tiny model needs little
    assert sum(p.kv_share for p in plans) <= 0.5


def test_pinned_models_get_cpu_sets_of_their_own_in_order():
    plans = plan_models(BOX, [ModelAsk("a", workers=3), ModelAsk("b", workers=1)], pin=True)
    assert [p.cpu_sets for p in plans] == [((0,), (1,), (2,)), ((3,),)]


def test_the_start_up_line_says_each_models_share():
    plans = plan_models(BOX, [ModelAsk("chat", workers=3), ModelAsk("summarize")])
    line = describe_models(["chat", "summarize"], plans)
    assert line.startswith("2 models — chat: 3 workers × 1 thread, KV ")
    assert "; summarize: 1 worker × 1 thread, KV " in line and "4 CPUs" in line


@pytest.mark.parametrize("asks, message", [
    ([ModelAsk("a"), ModelAsk("a")], "two models have the same name: a"),
    ([ModelAsk("a", workers=0), ModelAsk("b")], "model 'a': workers must be at least 1"),
])
def test_a_bad_split_is_refused_with_what_to_fix(asks, message):
    with pytest.raises(ValueError, match=message):
        plan_models(BOX, asks)


def test_model_flags_name_each_model_and_give_counts_by_name():
    assert model_flags(None, None, None) == [ModelFlag(None, None)]  # the default model
    assert model_flags(["tiny"], "chat", None) == [ModelFlag("chat", "tiny")]
    assert model_flags(["chat=tiny", "/models/smol"], None, ["chat=2"]) == [ModelFlag("chat", "tiny", 2),
                                                                             ModelFlag(None, "/models/smol")]


@pytest.mark.parametrize("models, name, counts, message", [
    (["a=tiny", "b=tiny"], "x", None, "--model-name names the one model"),
    (["=tiny"], None, None, "model name ''"),
    (["a="], None, None, "say which model after '='"),
    (["a b=tiny"], None, None, "model name 'a b'"),
    (["a=tiny"], None, ["b=1"], "--model-workers names 'b', not a model"),
    (["a=tiny"], None, ["a=0"], "give NAME=N with N at least 1"),
    (["tiny"], None, ["tiny=1"], "give it a name"),
])
def test_bad_model_flags_are_refused_with_what_to_fix(models, name, counts, message):
    with pytest.raises(ValueError, match=message):
        model_flags(models, name, counts)


def test_a_catalog_resolves_a_name_to_its_current_version_and_name_at_version_to_that_one():
    import pathlib

    from tokenline.server.catalog import ModelCatalog, ServedModel

    def served(version: str, key: str = "") -> ServedModel:
        return ServedModel(name="chat", path=pathlib.Path("/m"), version=version, max_context=64, vocab_size=10,
                           tokenizer=None, key=key)

    catalog = ModelCatalog()
    v1, v2 = served("v1"), served("v2", key="chat@v2")
    catalog.add(v1, current=True)
    catalog.add(v2, current=False)
    assert catalog["chat"] is v1 and catalog["chat@v2"] is v2 and catalog["chat@v1"] is v1
    assert catalog.set_current("chat@v2") == "chat"
    assert catalog["chat"] is v2 and catalog["chat@v1"] is v1  # the old version by its pinned name
    assert sorted(m.version for m in catalog.values()) == ["v1", "v2"]  # each loaded version once
    with pytest.raises(ValueError, match="is the current version"):
        catalog.remove("chat@v2")
    catalog.remove("chat")
    assert "chat@v1" not in catalog and catalog["chat"] is v2 and len(catalog) == 1
    assert "chat@v3" not in catalog and "other" not in catalog


def test_only_a_tenant_marked_admin_in_the_keys_file_may_operate_the_server(tmp_path):
    import json

    from tokenline.server.auth import Authenticator, hash_key, load_tenants

    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {"ops": {"keys": [hash_key("k1")], "admin": True},
                                            "app": {"keys": [hash_key("k2")]}}}))
    auth = Authenticator(str(path))
    assert auth.is_admin("ops") and not auth.is_admin("app") and not auth.is_admin("nobody")
    assert not Authenticator(None).is_admin("default")  # with authentication off: loopback callers only (admin.py)
    path.write_text(json.dumps({"tenants": {"ops": {"keys": [hash_key("k1")], "admin": "yes"}}}))
    with pytest.raises(ValueError, match="admin must be true or false"):
        load_tenants(path)


def test_an_adapter_resolves_to_its_models_current_version_and_its_pinned_name_to_that_base_alone(tmp_path):
    import pathlib

    from tokenline.server.catalog import ModelCatalog, ServedModel

    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    catalog = ModelCatalog()
    v1 = ServedModel(name="chat", path=pathlib.Path("/m"), version="v1", max_context=64, vocab_size=10, tokenizer=None)
    v2 = ServedModel(name="chat", path=pathlib.Path("/m"), version="v2", max_context=64, vocab_size=10, tokenizer=None,
                     key="chat@v2")
    catalog.add(v1, current=True)
    catalog.add(v2, current=False)
    catalog.add_adapter("chat", "tuned", 1, str(folder))
    on_v1 = catalog["tuned"]
    assert (on_v1.key, on_v1.adapter, on_v1.base) == ("chat", ("tuned", 1, str(folder)), "chat")
    assert on_v1.lora_on and catalog["chat"].lora_on  # prompt log-probabilities refused on both (server/convert.py)
    assert catalog[f"tuned@{on_v1.version}"].key == "chat" and [a.name for a in catalog.adapters()] == ["tuned"]
    catalog.set_current("chat@v2")  # a rollout of its model: the adapter follows, under another version
    on_v2 = catalog["tuned"]
    assert on_v2.key == "chat@v2" and on_v2.version != on_v1.version
    assert f"tuned@{on_v1.version}" not in catalog  # pinned to the old base: not continued on the new one
    assert "tuned@nope" not in catalog and "chat" in catalog
    v3 = ServedModel(name="chat", path=pathlib.Path("/m"), version="v3", max_context=64, vocab_size=10, tokenizer=None,
                     key="chat@v3")
    catalog.add(v3, current=True)  # rolled out after the adapter was added: its workers run LoRA too (admin.py)
    assert catalog["chat"].lora_on and catalog["tuned"].key == "chat@v3"


@pytest.mark.parametrize("values, message", [
    (["tuned"], "give NAME=FOLDER"),
    (["other/tuned=/a"], "'other' is not a served model"),
    (["a=/x"], "the name 'a' is taken"),
    (["t=/x", "t=/y"], "the name 't' is taken"),
    (["bad name=/x"], "LoRA adapter name"),
])
def test_bad_lora_flags_are_refused_with_what_to_fix(values, message):
    from tokenline.server.model_flags import lora_flags

    with pytest.raises(ValueError, match=message):
        lora_flags(values, ["a", "b"])


def test_a_lora_flag_without_a_model_is_the_first_models():
    from tokenline.server.model_flags import lora_flags

    assert lora_flags(["t=/x", "b/u=/y"], ["a", "b"]) == {"a": (("t", "/x"),), "b": (("u", "/y"),)}
