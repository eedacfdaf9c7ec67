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


def test_max_loras_without_a_model_is_every_models_and_a_model_s_own_overrides_it():
    from tokenline.server.model_flags import max_loras_flags

    assert max_loras_flags(None, ["a", "b"]) == {"a": 0, "b": 0}
    assert max_loras_flags(["2"], ["a", "b"]) == {"a": 2, "b": 2}
    assert max_loras_flags(["2", "b=0"], ["a", "b"]) == {"a": 2, "b": 0}
    for bad, message in (("x", "give N"), ("-1", "give N"), ("c=1", "'c' is not a served model"), ("=1", "give N")):
        with pytest.raises(ValueError, match=message):
            max_loras_flags([bad], ["a", "b"])


def test_lora_slots_are_counted_in_the_plan_before_the_kv_cache():
    from tokenline.engine.lora import slot_bytes

    smol = {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
            "num_key_value_heads": 3}
    # Per layer and rank: q/k/v (576 in, 960 out), o (576, 576), gate/up (576, 3072), down (1536, 576); float32.
    assert slot_bytes(smol, 16) == 30 * 16 * (576 + 960 + 576 + 576 + 576 + 3072 + 1536 + 576) * 4
    lora = 512 * MiB
    plain = plan_workers(BOX, workers=2)
    adapted = plan_workers(BOX, workers=2, extra_bytes=lora)
    assert adapted.kv_cache_bytes < plain.kv_cache_bytes
    two = plan_models(BOX, [ModelAsk("a", extra_bytes=lora), ModelAsk("b")])
    assert two[0].kv_cache_bytes == two[1].kv_cache_bytes < plan_models(BOX, [ModelAsk("a"), ModelAsk("b")])[0].kv_cache_bytes


def test_adapter_ids_are_never_reused_and_an_unloading_adapter_keeps_its_slot(tmp_path):
    import pathlib

    from tokenline.server.catalog import ModelCatalog, ServedModel

    folder = tmp_path / "tuned"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(b"weights")
    catalog = ModelCatalog()
    catalog.lora_capacity["chat"] = 2
    catalog.add(ServedModel(name="chat", path=pathlib.Path("/m"), version="v1", max_context=64, vocab_size=10,
                            tokenizer=None), current=True)
    assert catalog["chat"].lora_on  # room for adapters: LoRA on before the first is loaded
    catalog.add_adapter("chat", "a", catalog.next_lora_id("chat"), str(folder))
    catalog.add_adapter("chat", "b", catalog.next_lora_id("chat"), str(folder))
    assert catalog.remove_adapter("a")[:2] == ("chat", 1)
    assert "a" not in catalog and catalog.adapters_of("chat") == ["b", "a"]  # "a" holds its slot while it drains
    catalog.unloading.pop("a")
    assert catalog.adapters_of("chat") == ["b"] and catalog.next_lora_id("chat") == 3


def test_an_adapter_whose_weights_do_not_fit_the_model_is_refused_from_its_header(tmp_path):
    import json
    import struct

    from tokenline.engine.lora import AdapterError, check_weights

    def write(tensors: dict) -> None:
        header = json.dumps({k: {"dtype": "F32", "shape": v, "data_offsets": [0, 0]} for k, v in tensors.items()})
        (tmp_path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode())

    write({"x.q_proj.lora_A.weight": [8, 64], "x.q_proj.lora_B.weight": [64, 8]})
    check_weights(tmp_path, 8, 64)
    with pytest.raises(AdapterError, match="rank 8, above the 4"):
        check_weights(tmp_path, 4, 64)
    with pytest.raises(AdapterError, match="hidden size"):
        check_weights(tmp_path, 8, 576)
    write({"x.q_proj.weight": [64, 64]})
    with pytest.raises(AdapterError, match="no lora_A"):
        check_weights(tmp_path, 8, 64)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\xff" * 12)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_weights(tmp_path, 8, 64)


def test_a_keys_file_gives_a_tenant_a_limit_per_model():
    import json
    import tempfile
    from pathlib import Path

    from tokenline.server.auth import hash_key, load_tenants

    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "keys.json"
        path.write_text(json.dumps({"tenants": {"app": {"keys": [hash_key("k")], "models": {"chat": {"max_concurrent": 4}}}}}))
        quota = load_tenants(path)["app"].quota
        assert quota.concurrent_on("chat") == 4 and quota.concurrent_on("draft") is None
        for models, message in (({"chat": {"max_concurrent": "4"}}, "whole number"), ({"chat": 4}, "must be an object"),
                                ({"chat": {"max_concurrent": 0}}, ">= 1"), ({"chat": {"weight": 2}}, "must be an object")):
            path.write_text(json.dumps({"tenants": {"app": {"keys": [hash_key("k")], "models": models}}}))
            with pytest.raises(ValueError, match=message):
                load_tenants(path)


def test_a_model_flag_may_label_its_version_and_a_folder_with_an_at_sign_is_not_split(tmp_path):
    folder = tmp_path / "smol@2024"
    folder.mkdir()
    assert model_flags(["chat=/models/smol@v2", f"old={folder}", "tiny"], None, None) == [
        ModelFlag("chat", "/models/smol", version="v2"), ModelFlag("old", str(folder)), ModelFlag(None, "tiny")]
    with pytest.raises(ValueError, match="version label"):
        model_flags(["chat=/models/smol@bad label"], None, None)
