"""`moeshard convert FILE.gguf` (issue 39) on GGUF files made by llama.cpp's own converter from
the repository's test checkpoints (tools/make_gguf_fixtures.py): the imported model gives
transformers' logits and tokens, the same bits as the safetensors conversion, and the
tokenizer rebuilt from the file encodes as the original tokenizer.json."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import FIXTURES, ROOT, reference

from moeshard.cli import main
from moeshard.coordinator.generate import SamplingOptions, generate
from moeshard.coordinator.runtime import open_local
from moeshard.moe.convert.gguf_import import convert_gguf, gguf_parts
from moeshard.moe.errors import CheckpointError

GGUF = FIXTURES / "gguf"
TOLERANCE = 1e-4  # of the reference logit range, as tests/test_reference.py


# llama.cpp's qwen3moe, qwen2moe, olmoe, llama with experts (its q/k rows permuted) and
# deepseek2 (kv_b split in two; with and without q_lora, as DeepSeek-V3 and Kimi-K2)
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "deepseek_v3_fp8")


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """imports(fixture) -> its f32 GGUF converted with f32 experts and trunk (once)."""
    root, done = tmp_path_factory.mktemp("gguf"), {}

    def get(name: str):
        if name not in done:
            done[name] = root / name
            convert_gguf(GGUF / f"{name}-f32.gguf", done[name], "f32", "f32", progress=False)
        return done[name]

    return get


@pytest.fixture
def imported(imports):
    return imports("qwen3_moe")


@pytest.mark.parametrize("name", FAMILIES)
def test_an_imported_f32_gguf_matches_transformers(imports, name):
    ref = reference(name)
    rt = open_local(imports(name))
    logits = rt.transformer.forward(ref["prompt_ids"], rt.transformer.new_cache(64))  # [T, V]
    span = float(ref["prefill_logits"].max() - ref["prefill_logits"].min())
    assert float(np.abs(logits - ref["prefill_logits"]).max()) <= TOLERANCE * span
    prompt = [int(t) for t in ref["prompt_ids"]]
    opts = SamplingOptions(max_tokens=len(ref["greedy_ids"]), keep_logits=True)
    result = generate(rt.transformer, prompt, opts)
    assert result.tokens == [int(t) for t in ref["greedy_ids"]]
    assert float(np.abs(np.stack(result.logits) - ref["greedy_logits"]).max()) <= TOLERANCE * span


@pytest.mark.parametrize("name", FAMILIES)
def test_the_gguf_gives_the_bits_of_the_safetensors(imports, converted, name):
    """The file holds the checkpoint's f32 values: the same trunk and expert records, so
    the same logits bit for bit (only config.json's wording differs)."""
    ref = reference(name)
    imported, outs = imports(name), []
    for model in (imported, converted(name)):
        rt = open_local(model)
        outs.append(rt.transformer.forward(ref["prompt_ids"], rt.transformer.new_cache(64)))
    assert np.array_equal(outs[0], outs[1])
    manifest = json.loads((imported / "moeshard.json").read_text())
    assert manifest["converted_from"].endswith(f"{name}-f32.gguf")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_config_reads_as_the_checkpoints(imports, name):
    """The config.json written from the GGUF metadata (and the choices llama.cpp's graph
    hard-codes per architecture) reads as the checkpoint's own: every field moeshard's
    config takes is equal."""
    from dataclasses import asdict

    from moeshard.moe.model.families import load_config

    assert asdict(load_config(imports(name))) == asdict(load_config(FIXTURES / name))


def test_the_tokenizer_rebuilt_from_the_file_encodes_as_the_original(imported):
    from tokenizers import Tokenizer

    rebuilt = Tokenizer.from_file(str(imported / "tokenizer.json"))
    original = Tokenizer.from_file(str(FIXTURES / "qwen3_moe" / "tokenizer.json"))
    corpus = [
        (ROOT / "README.md").read_text(),
        (ROOT / "docs" / "usage.md").read_text(),
        "  spaces\t\ttabs\n\nnew lines <|endoftext|> ÿ 漢字 don't we'll 12345 3.14",
    ]
    for text in corpus:
        ids = original.encode(text).ids
        assert rebuilt.encode(text).ids == ids
        assert rebuilt.decode(ids) == original.decode(ids)
    config = json.loads((imported / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and config["add_bos_token"] is False


def test_convert_on_the_command_line_takes_a_gguf_and_a_tokenizer(tmp_path, capsys):
    out = tmp_path / "m"
    tokenizer = FIXTURES / "qwen3_moe" / "tokenizer.json"
    src = str(GGUF / "qwen3_moe-f32.gguf")
    assert main(["convert", src, str(out), "--quiet", "--tokenizer", str(tokenizer)]) == 0
    assert "converted" in capsys.readouterr().out
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert (out / "tokenizer_config.json").read_bytes() == tokenizer.with_name(
        "tokenizer_config.json"
    ).read_bytes()


@pytest.mark.parametrize(
    ("source", "fmt"),
    [
        ("qwen3_moe-q8_0", "q8_0"),
        ("qwen3_moe-q4_0", "q4_0"),
        ("qwen3_moe-mxfp4_moe", "mxfp4"),
        ("qwen3_moe_wide-q4_k_m", "q4_K,q4_K/q6_K"),
        ("qwen3_moe_wide-iq4_xs", "iq4_xs"),
        ("qwen3_moe_wide-iq4_nl", "iq4_nl"),
    ],
)
def test_quantized_experts_are_kept_bit_for_bit(tmp_path, source, fmt):
    """llama-quantize's Q8_0, Q4_0, MXFP4, Q4_K_M, IQ4_XS and IQ4_NL experts (the last three:
    of a model 256 wide; Q4_K_M gives its second layer's down projections Q6_K, the first's
    Q4_K) become records of those formats by default, every block the file's own (reordered only),
    and the model runs within 8-bit activations' error of the same file decoded to f32."""
    from gguf import GGUFReader

    from moeshard.moe.kernels.layout import packed_nbytes, unpack_to_ggml
    from moeshard.moe.kernels.quant import record_format, record_matrix_formats
    from moeshard.moe.model.model_dir import ModelDir

    src = GGUF / f"{source}.gguf"
    kept, decoded = tmp_path / "kept", tmp_path / "decoded"
    convert_gguf(src, kept, progress=False)
    convert_gguf(src, decoded, "f32", "f32", progress=False)
    assert json.loads((kept / "moeshard.json").read_text())["expert_format"] == fmt
    stacks = {t.name: t for t in GGUFReader(src).tensors if "_exps." in t.name}
    model = ModelDir(kept)
    shards, c = model.shard_set, model.config
    layers, experts = c.num_hidden_layers, c.n_experts
    hidden, inter = c.expert_hidden, c.expert_intermediate
    for layer in range(layers):
        formats = record_matrix_formats(record_format(fmt, layer))
        for expert in range(experts):
            record, at = shards.read(layer, expert), 0
            for proj, (rows, cols), f in zip(
                ("gate", "up", "down"),
                ((inter, hidden), (inter, hidden), (hidden, inter)),
                formats,
                strict=True,
            ):
                n = packed_nbytes(f, rows, cols)
                got = unpack_to_ggml(record[at : at + n], f, rows, cols)
                want = np.asarray(stacks[f"blk.{layer}.ffn_{proj}_exps.weight"].data[expert])
                assert np.array_equal(got.reshape(-1), want.view(np.uint8).reshape(-1))
                at += n
    prompt = reference("qwen3_moe")["prompt_ids"]
    runs = [open_local(m).transformer for m in (kept, decoded)]
    a, b = (t.forward(prompt, t.new_cache(16)) for t in runs)  # [T, V]
    assert float(np.abs(a - b).max()) <= 0.02 * float(b.max() - b.min())


@pytest.mark.parametrize(("name", "variant"), [("qwen3_moe", "q8_0"), ("mixtral", "f32")])
def test_the_trunk_keeps_its_bits_where_its_format_is_the_files(tmp_path, name, variant):
    """A file whose trunk matrices are all Q8_0 (or F32) gets that trunk format by default,
    every matrix packed from the file's own blocks; Mixtral's q/k rows move whole, undecoded,
    back from llama.cpp's RoPE order."""
    from gguf import GGUFReader

    from moeshard.moe.convert.gguf_import import unpermute_rows
    from moeshard.moe.kernels.layout import unpack_to_ggml
    from moeshard.moe.storage.trunk_file import TrunkLayout, read_trunk_tensors

    src = GGUF / f"{name}-{variant}.gguf"
    out = tmp_path / "m"
    convert_gguf(src, out, progress=False)
    assert json.loads((out / "moeshard.json").read_text())["trunk_format"] == variant
    stored = read_trunk_tensors(TrunkLayout(out / "trunk.gguf"))
    tensors = {t.name: t for t in GGUFReader(src).tensors}
    heads = {"attn_q": 4, "attn_k": 2}  # (mixtral's fixture: 4 heads, 2 kv heads)
    for gguf_name, hf in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
    ):
        t = stored[hf]
        assert t.fmt == variant
        want = np.asarray(tensors[gguf_name].data).view(np.uint8).reshape(t.shape[0], -1)
        if name == "mixtral" and "attn_" in gguf_name:
            want = unpermute_rows(want, heads[gguf_name.split(".")[2]])
        assert np.array_equal(unpack_to_ggml(t.data, variant, *t.shape), want), gguf_name
    if name == "mixtral":  # the f32 trunk kept: the same model as the checkpoint's
        ref = reference(name)
        rt = open_local(out)
        logits = rt.transformer.forward(ref["prompt_ids"], rt.transformer.new_cache(16))
        span = float(ref["prefill_logits"].max() - ref["prefill_logits"].min())
        assert float(np.abs(logits - ref["prefill_logits"]).max()) <= TOLERANCE * span


def test_experts_of_a_type_moeshard_has_not_are_repacked_with_their_cost_printed(tmp_path, capsys):
    """llama-quantize's Q2_K (every matrix, --pure) of the 256-wide model: moeshard has no
    kernels for it, so the experts are decoded and packed as q4_0, and convert prints what
    that cost; the 64-wide Q4_K_M file's Q5_0 and Q8_0 experts packed as q4_0 on request
    likewise (each mix of types its line)."""
    runs = (("qwen3_moe_wide-q2_k", []), ("qwen3_moe-q4_k_m", ["--experts", "q4_0"]))
    for name, extra in runs:
        out = tmp_path / name
        assert main(["convert", str(GGUF / f"{name}.gguf"), str(out), "--quiet", *extra]) == 0
        text = capsys.readouterr().out
        lines = [ln for ln in text.splitlines() if ln.startswith("experts stored")]
        assert lines, f"no line on the re-quantized experts of {name}"
        for line in lines:
            error = float(line.split("relative RMS error of their weights ")[1].split()[0])
            assert 0.005 < error < 0.2, line  # (4 bits from 2 or 5: about 0.1; from 8: less)
        assert json.loads((out / "moeshard.json").read_text())["expert_format"] == "q4_0"
        rt = open_local(out)
        prompt = reference("qwen3_moe")["prompt_ids"]
        assert np.isfinite(rt.transformer.forward(prompt, rt.transformer.new_cache(16))).all()


def test_a_tokenizer_that_does_not_load_is_refused_and_leaves_nothing(tmp_path, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE"')  # cut short
    out = tmp_path / "m"
    src = str(GGUF / "qwen3_moe-f32.gguf")
    assert main(["convert", src, str(out), "--quiet", "--tokenizer", str(bad)]) == 2
    assert "not a tokenizer.json" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json"]


@pytest.mark.parametrize("keep", [3000, 500_000])
def test_a_truncated_gguf_is_refused_and_leaves_nothing(tmp_path, capsys, keep):
    src = tmp_path / "cut.gguf"
    src.write_bytes((GGUF / "qwen3_moe-f32.gguf").read_bytes()[:keep])
    out = tmp_path / "m"
    assert main(["convert", str(src), str(out), "--quiet"]) == 2
    assert "truncated or malformed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_an_architecture_not_imported_is_named(tmp_path):
    from gguf import GGUFReader, GGUFWriter

    src = tmp_path / "other.gguf"
    reader = GGUFReader(GGUF / "qwen3_moe-f32.gguf")
    writer = GGUFWriter(str(src), "bert")
    tensor = reader.tensors[0]
    writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'bert' cannot be imported yet"):
        convert_gguf(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_a_split_model_imports_from_any_part(tmp_path, imported):
    """The fixture rewritten as a three-part split model (gguf's writer, llama.cpp's split
    format: the metadata in the first part, split.* keys in every part), given by its
    middle part: the same model as the single file."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(GGUF / "qwen3_moe-f32.gguf")
    writer = GGUFWriter(str(tmp_path / "m.gguf"), "qwen3moe", split_max_tensors=15)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the writer's own)
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(p.name for p in tmp_path.glob("m-*.gguf"))
    assert parts == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    out = tmp_path / "split"
    convert_gguf(tmp_path / parts[1], out, "f32", "f32", progress=False)
    prompt = reference("qwen3_moe")["prompt_ids"]
    a, b = (open_local(m).transformer for m in (out, imported))
    assert np.array_equal(a.forward(prompt, a.new_cache(16)), b.forward(prompt, b.new_cache(16)))


def test_a_split_model_needs_every_part(tmp_path):
    first = tmp_path / "m-00001-of-00002.gguf"
    shutil.copyfile(GGUF / "qwen3_moe-f32.gguf", first)
    with pytest.raises(CheckpointError, match="missing m-00002-of-00002.gguf"):
        gguf_parts(first)
    assert gguf_parts(tmp_path / "plain.gguf") == [tmp_path / "plain.gguf"]


# Pre-tokenizers as the models' own tokenizer.json files write them (Qwen2/Qwen3, Llama 3,
# DeepSeek-V3), written out here apart from the importer's code.
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _splits(*patterns):
    return {
        "type": "Sequence",
        "pretokenizers": [
            *(
                {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
                for p in patterns
            ),
            _BYTES,
        ],
    }


MODEL_PRE_TOKENIZERS = {
    "qwen2": _splits(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
        "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    ),
    "llama-bpe": _splits(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}"
        "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    ),
    "deepseek-v3": _splits(
        "\\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
        "\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
}


@pytest.mark.parametrize("pre", sorted(MODEL_PRE_TOKENIZERS))
def test_the_pre_tokenizers_of_popular_models_are_rebuilt(tmp_path, pre):
    """A GGUF naming `pre` (the fixture's vocabulary and merges) rebuilds the tokenizer the
    model's tokenizer.json describes: the same ids on text where the pre-tokenizers differ
    (digit runs, contractions, CJK, punctuation before letters)."""
    from gguf import GGUFReader, GGUFWriter
    from tokenizers import Tokenizer

    from moeshard.moe.convert.gguf_tokenizer import tokenizer_json

    fields = GGUFReader(GGUF / "qwen3_moe-f32.gguf").fields
    src = tmp_path / "t.gguf"
    writer = GGUFWriter(str(src), "qwen3moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    rebuilt = Tokenizer.from_str(tokenizer_json(GGUFReader(src).fields, src))
    spec = json.loads((FIXTURES / "qwen3_moe" / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = MODEL_PRE_TOKENIZERS[pre]
    want = Tokenizer.from_str(json.dumps(spec))
    text = (
        "In 2024, 1234567 people didn't say 'HELLO' we'll... x=3.14159!!\n\n\t漢字かなカナ "
        "über-cool #tag @user (a)[b]{c} <|endoftext|>" + (ROOT / "README.md").read_text()[:4000]
    )
    assert rebuilt.encode(text).ids == want.encode(text).ids

    def pieces(tokenizer):
        return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    assert pieces(rebuilt) == pieces(want)
    for other in (p for p in MODEL_PRE_TOKENIZERS if p != pre):  # (the text tells them apart)
        spec["pre_tokenizer"] = MODEL_PRE_TOKENIZERS[other]
        assert pieces(Tokenizer.from_str(json.dumps(spec))) != pieces(want), other


def test_quality_compares_gguf_files_with_the_checkpoint(capsys):
    """`moeshard quality SRC --gguf FILE`: the f32 GGUF of the same checkpoint is the reference
    itself (top-1 100%, KL 0); its Q4_0 and Q4_K_M mixes cost something, each row labelled
    with the file's expert types and the formats they ran in (Q4_K_M's fallbacks for 64-wide
    rows, Q5_0 and Q8_0, kept: 8-bit activations only)."""
    src = FIXTURES / "qwen3_moe"
    ggufs = [GGUF / f"qwen3_moe-{v}.gguf" for v in ("f32", "q4_0", "q4_k_m")]
    args = ["quality", str(src), "--prompt-ids", "1,2,3,4", "--tokens", "8", "--experts", "q4_0"]
    assert main([*args, *(a for g in ggufs for a in ("--gguf", str(g)))]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        if len(parts) == 7 and parts[1].startswith("gguf:"):
            rows[(parts[0], parts[1][5:], parts[2])] = (float(parts[4][:-1]), float(parts[5]))
    assert rows[("F32>f32", "qwen3_moe-f32.gguf", "-")] == (100.0, 0.0)
    assert set(rows) >= {
        ("Q4_0>q4_0", "qwen3_moe-q4_0.gguf", "q8"),
        ("Q4_0>q4_0", "qwen3_moe-q4_0.gguf", "f32"),
        ("Q5_0/Q8_0>q5_0/q8_0", "qwen3_moe-q4_k_m.gguf", "q8"),
    }
    for key, (_, kl) in rows.items():
        assert kl > 0 or key[0] == "F32>f32", key


def test_a_mix_of_k_quants_runs_the_same_on_nodes_and_under_a_ram_budget(tmp_path):
    """A Q4_K_M file's experts as they are (q4_K, and q4_K/q6_K records in its second layer;
    the first layer's stored without the padding to the model's record size): the same tokens
    and logits bits through 3 nodes (2 replicas, the audits on) and streamed under the
    smallest budget, as in RAM."""
    from helpers import same_bits_everywhere

    from moeshard.moe.model.model_dir import ModelDir

    model = tmp_path / "m"
    convert_gguf(GGUF / "qwen3_moe_wide-q4_k_m.gguf", model, progress=False)
    shards = ModelDir(model).shard_set
    small, big = shards.location(0, 0).nbytes, shards.location(1, 0).nbytes
    assert small < big == shards.record_nbytes  # layer 0's q4_K records: no padding stored
    whole = shards.read(0, 0)  # ... but read as the model's record size, zeros after
    assert whole.size == shards.record_nbytes and not whole[small:].any()
    prompt = [int(t) for t in reference("qwen3_moe")["prompt_ids"]]
    same_bits_everywhere(model, prompt, tmp_path / "shards", 3, 2)


def test_a_nan_block_scale_is_refused_naming_the_record_and_leaves_nothing(tmp_path, capsys):
    """A kept block whose float16 scale is nan (a corrupted file): its products would carry a
    nan whose sign depends on instruction order, so nodes could disagree bit for bit."""
    from gguf import GGUFReader

    src = tmp_path / "bad.gguf"
    shutil.copyfile(GGUF / "qwen3_moe_wide-q4_k_m.gguf", src)
    tensor = next(t for t in GGUFReader(src).tensors if t.name == "blk.1.ffn_up_exps.weight")
    with open(src, "r+b") as f:  # expert 0's first Q4_K block starts with d (float16)
        f.seek(int(tensor.data_offset))
        f.write(np.array([np.nan], dtype=np.float16).tobytes())
    out = tmp_path / "m"
    assert main(["convert", str(src), str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "expert 0 of layer 1" in err and "nan or inf scale" in err, err
    assert not out.exists()


def test_a_model_whose_expert_format_misses_a_layer_is_refused_at_open(tmp_path):
    from moeshard.moe.errors import StoreError
    from moeshard.moe.kernels import quant
    from moeshard.moe.model.model_dir import ModelDir

    model = tmp_path / "m"
    convert_gguf(GGUF / "qwen3_moe_wide-q4_k_m.gguf", model, progress=False)
    manifest = json.loads((model / "moeshard.json").read_text())
    for spec, why in (("q4_K,-", "no experts for layer 1"), ("q4_K,q4_K,q4_K", "has 3 layers")):
        manifest["expert_format"] = spec
        (model / "moeshard.json").write_text(json.dumps(manifest))
        with pytest.raises(StoreError, match=why):
            ModelDir(model)
    with pytest.raises(ValueError, match="not one record format"):
        quant.record_matrix_formats("q4_K,q4_K/q6_K")
