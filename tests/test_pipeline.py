"""The compile pipeline end to end: what it writes into the bundle and what it refuses."""

import json
import resource
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import transformers as tf
from onnx import numpy_helper

from conftest import PROMPTS, make_checkpoint, on_a_terminal, save_bf16_shards
from specbuild.compile import compile_bundle
from specbuild.compile.graphs import build_decoder
from specbuild.compile.load import load_checkpoint
from specbuild.compile.precision import Numerics
from specbuild.recipe import CompileSettings
from specbuild_runtime import SpecbuildError, SpeculativeDecoder


# Phases of compile that run for minutes at 7B and showed only their stage's name, the stage bar standing still.
COMPILE_PHASES = [
    (dict(quantize="int8"), ("measuring the target engine against fp32", "measuring the draft engine against fp32",
                             "measuring the pair's α", "checking the engines' graphs", "hashing the bundle's files")),
    (dict(backend="all"), ("writing TensorRT-LLM target", "writing TensorRT-LLM draft", "measuring α for γ")),
]


@pytest.mark.parametrize("settings, phases", COMPILE_PHASES)
def test_every_long_phase_of_compile_shows_progress_on_a_terminal(checkpoints, tmp_path, monkeypatch, settings, phases):
    terminal = on_a_terminal(monkeypatch)
    compile_bundle(CompileSettings(checkpoints("llama"), checkpoints("llama", 1), tmp_path / "b", max_seq_len=64, **settings))
    shown = terminal.getvalue()
    assert [phase for phase in phases if phase not in shown] == [], shown


@pytest.mark.parametrize("settings", [settings for settings, _ in COMPILE_PHASES])
def test_compile_prints_nothing_where_stderr_is_no_terminal(checkpoints, tmp_path, capsys, settings):
    target, draft = checkpoints("llama"), checkpoints("llama", 1)
    capsys.readouterr()  # what making them printed
    compile_bundle(CompileSettings(target, draft, tmp_path / "b", max_seq_len=64, **settings))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("settings", [settings for settings, _ in COMPILE_PHASES])
def test_compile_without_progress_draws_no_bar_even_on_a_terminal(checkpoints, tmp_path, monkeypatch, settings):
    """show_progress=False is the caller's word for every bar of the compile, the phases deep inside it too."""
    target, draft = checkpoints("llama"), checkpoints("llama", 1)  # made before: saving them draws transformers' bar
    terminal = on_a_terminal(monkeypatch)
    compile_bundle(CompileSettings(target, draft, tmp_path / "b", max_seq_len=64, **settings), show_progress=False)
    assert terminal.getvalue() == ""


def test_a_draft_of_another_family_with_the_targets_tokenizer_files_is_accepted(checkpoints, tmp_path):
    """transformers loads the same tokenizer files with another unk token for a Qwen2 checkpoint than for a
    Llama one; decoding never reads unk (or pad), so the pair stands and decodes as the target alone does."""
    target, draft = checkpoints("qwen2"), checkpoints("llama", 1)  # the Qwen2's q/k/v biases: the larger, the target
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    compile_bundle(CompileSettings(target=target, draft=draft, output=tmp_path / "b", max_seq_len=64), show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "b")
    ids = decoder.encode(PROMPTS[0])
    assert decoder.generate(ids, 16, gamma=3).token_ids == decoder.generate(ids, 16, gamma=0).token_ids


def test_a_tokenizer_saved_with_split_special_tokens_encodes_special_tokens_in_the_text_as_text(checkpoints, tokenizer,
                                                                                                   tmp_path):
    """transformers keeps split_special_tokens in tokenizer_config.json, where tokenizer.json cannot say it: the
    runtime read "<|endoftext|>" typed in a prompt as the special token, which transformers (and vLLM) spell out."""
    target = tmp_path / "target"
    shutil.copytree(checkpoints("llama"), target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "b", max_seq_len=64), show_progress=False)
    text = "<|endoftext|>" + PROMPTS[1]
    expected = tf.AutoTokenizer.from_pretrained(target)(text)["input_ids"]
    assert SpeculativeDecoder(tmp_path / "b").encode(text) == expected != tokenizer(text)["input_ids"]


def test_a_tokenizer_saved_with_truncation_and_padding_on_encodes_the_whole_prompt_as_transformers_does(checkpoints,
                                                                                                      tmp_path):
    """A tokenizer.json saved with truncation and padding on (a fine-tune's training settings): transformers turns
    both off for a call that asks for neither; the runtime cut every prompt to 3 tokens and padded it to 40."""
    target = tmp_path / "target"
    shutil.copytree(checkpoints("llama"), target)
    saved = tf.AutoTokenizer.from_pretrained(target)
    saved.backend_tokenizer.enable_truncation(3)
    saved.backend_tokenizer.enable_padding(length=40)
    saved.save_pretrained(target)
    compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "b", max_seq_len=64), show_progress=False)
    expected = tf.AutoTokenizer.from_pretrained(target)(PROMPTS[1])["input_ids"]
    decoder = SpeculativeDecoder(tmp_path / "b")
    assert decoder.encode(PROMPTS[1]) == expected and 3 < len(expected) < 40
    assert decoder.generate(PROMPTS[1], 8, gamma=3).token_ids == decoder.generate(expected, 8, gamma=0).token_ids


def test_a_base_draft_of_an_instruct_target_with_another_eos_is_accepted(checkpoints, tokenizer, tmp_path):
    """Qwen2.5-7B-Instruct's tokenizer ends at <|im_end|>, Qwen2.5-0.5B's at <|endoftext|>, over the same
    vocabulary (Llama 3.1 Instruct and base alike); the draft's eos is never read, and the pair was refused."""
    import shutil

    import transformers as tf

    vocab = len(tokenizer) + 1
    folders = {}
    for role, seed in (("target", 0), ("draft", 1)):
        folders[role] = tmp_path / role
        shutil.copytree(checkpoints("llama", seed, vocab_size=vocab), folders[role])
        own = tf.AutoTokenizer.from_pretrained(folders[role])
        own.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
        if role == "target":
            own.eos_token = "<|im_end|>"
        own.save_pretrained(folders[role])
    compile_bundle(CompileSettings(target=folders["target"], draft=folders["draft"], output=tmp_path / "b",
                                   max_seq_len=64), show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "b")
    ids = decoder.encode(PROMPTS[0])
    assert decoder.generate(ids, 16, gamma=3).token_ids == decoder.generate(ids, 16, gamma=0).token_ids


def test_a_draft_with_padding_rows_is_cut_to_the_targets_vocabulary(checkpoints, tokenizer, tmp_path):
    target = checkpoints("llama")
    vocab = len(tokenizer)
    padded = checkpoints("llama", 1, vocab_size=vocab + 16)
    manifest = compile_bundle(CompileSettings(target=target, draft=padded, output=tmp_path / "b", max_seq_len=64),
                              show_progress=False)
    assert manifest.engines["draft"].shape.vocab_size == manifest.engines["target"].shape.vocab_size == vocab
    decoder = SpeculativeDecoder(tmp_path / "b")
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert decoder.generate(ids, 12, gamma=4).token_ids == decoder.generate(ids, 12, gamma=0).token_ids
    sampled = decoder.generate(ids, 12, gamma=4, temperature=1.0, seed=0).token_ids
    assert all(0 <= t < vocab for t in sampled)


def test_a_target_with_padding_rows_decodes_its_padding_tokens_exactly_past_a_smaller_draft(checkpoints, tokenizer,
                                                                                               tmp_path):
    """Qwen2.5-7B (152064 rows) drafted by Qwen2.5-0.5B (151936): a random target emits its padding ids,
    which the draft cannot embed; it reads them as its last row, and the output stays the target's."""
    vocab = len(tokenizer)
    padded = checkpoints("llama", 0, vocab_size=vocab + 64)
    manifest = compile_bundle(CompileSettings(target=padded, draft=checkpoints("llama", 1), output=tmp_path / "b",
                                              max_seq_len=64), show_progress=False)
    assert (manifest.engines["target"].shape.vocab_size, manifest.engines["draft"].shape.vocab_size) == (vocab + 64, vocab)
    decoder = SpeculativeDecoder(tmp_path / "b")
    emitted = set()
    for prompt in PROMPTS[:4]:
        ids = tokenizer(prompt)["input_ids"]
        alone = decoder.generate(ids, 24, gamma=0).token_ids
        emitted.update(alone)
        for gamma in (1, 4, "auto"):
            assert decoder.generate(ids, 24, gamma=gamma).token_ids == alone
        sampled = [decoder.generate(ids, 24, gamma=4, temperature=1.0, seed=s).token_ids for s in range(3)]
        emitted.update(t for tokens in sampled for t in tokens)
    assert max(emitted) >= vocab, "the target never emitted a padding id: this test is hollow"


def test_a_draft_never_proposes_a_padding_id_of_its_own_table(tokenizer, tmp_path):
    """Target and draft tables padded alike past the tokenizer (a distilled draft of a Qwen target: 151936 rows
    for 151669 tokens). distill trains only the tokenizer's rows, so the draft's padding rows keep whatever
    logits they started with; here they outrank every real token (twice a real row each), as a zero row does
    beside a draft whose logits are all negative. Each such draft was a certain rejection: α 0 for a draft
    that, over the tokenizer's ids, is the target itself."""
    vocab = len(tokenizer)
    target = make_checkpoint(tmp_path / "target", "llama", tokenizer, vocab_size=2 * vocab)
    model = tf.LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight[vocab:] = 0  # a released target's padding rows: never its greedy choice
    model.save_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight[vocab:] = 2 * model.lm_head.weight[:vocab]
    model.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    manifest = compile_bundle(CompileSettings(target=target, draft=tmp_path / "draft", output=tmp_path / "b",
                                              max_seq_len=64), show_progress=False)
    decoder = SpeculativeDecoder(tmp_path / "b")
    ids = tokenizer(PROMPTS[0])["input_ids"]
    speculative = decoder.generate(ids, 24, gamma=4)
    assert speculative.token_ids == decoder.generate(ids, 24, gamma=0).token_ids
    assert max(speculative.token_ids) < vocab
    assert speculative.stats.acceptance_rate == 1.0
    assert (manifest.engines["target"].shape.vocab_size, manifest.engines["draft"].shape.vocab_size) == (2 * vocab, vocab)


def test_no_weight_is_read_until_the_engine_is_written_and_each_once(checkpoints):
    ckpt = load_checkpoint(checkpoints("llama"), "target")
    made = []
    model = build_decoder(ckpt, Numerics(), 64, progress=made.append)
    assert made == []
    tensors = [v.const_value for v in model.graph.initializers.values()]
    lazy = [t for t in tensors if isinstance(t, ir.LazyTensor)]
    assert all(t.nbytes < 1024 for t in tensors if not isinstance(t, ir.LazyTensor))  # constants, not weights
    assert sum(t.nbytes for t in lazy) > 0.9 * sum(e.end - e.start for e in ckpt.entries.values())
    for tensor in lazy:
        tensor.tobytes()
    assert len(made) == len(lazy) and sum(made) == sum(t.nbytes for t in lazy)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_each_engine_has_a_greedy_only_graph_and_the_draft_a_steps_graph_reading_the_engines_weights(quantize, checkpoints,
                                                                                            tmp_path):
    """What CUDA graphs need (onnxruntime refuses to capture a graph with If, Loop or Scan), at no cost in
    bundle size: every weight of the greedy-only graph is a reference into the engine's own data file."""
    out = tmp_path / "b"
    manifest = compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama", 1), output=out,
                                              max_seq_len=64, quantize=quantize), show_progress=False)

    def external(model):  # name -> (file, offset, length) of every weight stored outside the graph
        return {t.name: tuple(sorted((e.key, e.value) for e in t.external_data)) for t in model.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}

    for role, info in manifest.engines.items():
        full = onnx.load(str(out / info.file), load_external_data=False)
        greedy = onnx.load(str(out / info.greedy_file), load_external_data=False)
        assert not [n.op_type for n in greedy.graph.node if any(a.type == a.GRAPH for a in n.attribute)]  # If, Loop, Scan
        # the test sees what it looks for: the target's penalties' If, then the sampling one
        assert [n.op_type for n in full.graph.node if n.op_type == "If"] == ["If", "If"][role == "draft":]
        # nor the penalties', min_tokens' or logit_bias' inputs: it decides on the raw logits (the sampler applies them)
        penalties = {"repetition_penalty", "presence_penalty", "frequency_penalty", "prompt_mask", "output_counts",
                     "min_tokens_left", "stop_tokens"} if role == "target" else set()
        assert {i.name for i in full.graph.input} - {i.name for i in greedy.graph.input} == {
            "temperature", "top_k", "top_p", "min_p", "draft_probs", "uniforms", "logit_bias", *penalties}
        assert [o.name for o in greedy.graph.output if not o.name.startswith("present")] == ["logits", "accepted", "next_token"]
        shared, own = external(full), external(greedy)
        assert own and all(shared[name] == where for name, where in own.items()), role
        assert {dict(where)["location"] for where in own.values()} == {f"{role}.onnx.data"}
    assert not list(out.glob("*.greedy.onnx.data"))
    # The draft's steps graph: four steps, no control flow, the draft's weights each stored once.
    info = manifest.engines["draft"]
    assert not manifest.engines["target"].steps_file and info.steps_file == "draft.steps.onnx"
    steps = onnx.load(str(out / info.steps_file), load_external_data=False)
    assert not [n.op_type for n in steps.graph.node if any(a.type == a.GRAPH for a in n.attribute)]
    assert [o.name for o in steps.graph.output if not o.name.startswith("present")] == ["drafts"]
    assert [d.dim_value for d in steps.graph.output[-1].type.tensor_type.shape.dim] == [4]
    assert {i.name for i in steps.graph.input if i.name.startswith("total_len")} == {"total_len", "total_len.1",
                                                                                    "total_len.2", "total_len.3"}
    assert external(steps) == external(onnx.load(str(out / info.greedy_file), load_external_data=False))
    assert [n.name for n in steps.graph.node if n.op_type == "GroupQueryAttention"].count("layers.0.attention") == 1
    sampler = onnx.load(str(out / manifest.sampler_file))  # how the greedy-only graphs sample: no weights
    assert manifest.sampler_file == "sampler.onnx" and sum(t.ByteSize() for t in sampler.graph.initializer) < 4096  # constants, no weight
    assert {"logits", "input_ids", "uniforms", "temperature", "logit_bias"} <= {i.name for i in sampler.graph.input}
    assert [n.op_type for n in sampler.graph.node if n.op_type == "If"] == ["If", "If"]  # the penalties', greedy or sampled


@pytest.mark.parametrize("gamma, steps", [(1, 0), (3, 3)])
def test_the_drafts_steps_graph_drafts_at_most_max_gamma_and_is_left_out_at_one(gamma, steps, checkpoints, tmp_path):
    """At max γ 1 every round drafts one token: a steps graph would only cost its session."""
    manifest = compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama", 1), output=tmp_path / "b",
                                              max_seq_len=64, gamma=gamma), show_progress=False)
    info = manifest.engines["draft"]
    assert bool(info.steps_file) == bool(steps) and len(list((tmp_path / "b").glob("*.steps.onnx"))) == bool(steps)
    if steps:
        graph = onnx.load(str(tmp_path / "b" / info.steps_file), load_external_data=False)
        assert [d.dim_value for d in graph.graph.output[-1].type.tensor_type.shape.dim] == [steps]


def test_a_bf16_checkpoint_becomes_an_fp16_engine_with_the_same_weights(checkpoints, tmp_path):
    tensors = save_bf16_shards(checkpoints("llama"), tmp_path / "bf16")
    manifest = compile_bundle(CompileSettings(target=tmp_path / "bf16", draft=tmp_path / "bf16", output=tmp_path / "b",
                                              max_seq_len=64, precision="fp16"), show_progress=False)
    info = manifest.engines["target"]
    assert (info.source_dtype, info.precision) == ("bf16", "fp16")
    assert manifest.build["peak_rss_bytes"] > 0 and "writing engines" in manifest.build["stages"]
    engine = onnx.load(str(tmp_path / "b" / "target.onnx"))
    stored = {t.name: numpy_helper.to_array(t) for t in engine.graph.initializer}
    name = "model.layers.1.mlp.down_proj.weight"
    expected = tensors[name].float().numpy().astype(np.float16)
    assert stored[name].dtype == np.float16 and np.array_equal(stored[name], expected)


def test_the_recorded_peak_memory_is_the_compiles_not_the_processs(checkpoints, tmp_path):
    held = np.ones(2**30 // 8)  # 1 GiB touched, then freed: work this process did before compiling
    del held
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    manifest = compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama"), output=tmp_path / "b",
                                              max_seq_len=64), show_progress=False)
    assert 0 < manifest.build["peak_rss_bytes"] < peak_before - 2**29


@pytest.mark.parametrize("value, precision, says", [(float("nan"), "fp32", "holds NaN: the checkpoint is damaged"),
                                                    (1e5, "fp16", r"holds 1e\+05, beyond fp16's largest number")],
                         ids=["nan", "beyond-fp16"])
def test_a_bad_value_in_a_weight_onnx_ir_writes_inline_is_the_checkpoints_error(checkpoints, tmp_path, value, precision,
                                                                              says):
    """A norm of a tiny model (at most 256 bytes; at real size Qwen3's q and k norms in fp16) goes into the graph's
    file, written by onnx_ir's serializer, which wrapped the error in its own: an internal error, exit 3."""
    from safetensors.torch import load_file, save_file

    from specbuild.errors import CheckpointError

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints("llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.input_layernorm.weight"][0] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"weight model.layers.0.input_layernorm.weight of {folder} {says}"):
        compile_bundle(CompileSettings(target=folder, draft=checkpoints("llama", 1), output=tmp_path / "b",
                                       max_seq_len=64, precision=precision), show_progress=False)


def test_a_bug_raised_while_onnx_ir_writes_a_weight_inline_keeps_what_raised_it(checkpoints, tmp_path, monkeypatch):
    """Only the checkpoint's errors are taken out of onnx_ir's SerdeError: any other stays one, with its cause, which
    `specbuild --debug` shows (raising it `from None` had cut the chain, leaving a traceback that ends in onnx_ir)."""
    from specbuild.compile.graphs import builder

    def convert_into(rows, out, plus_one=False, name="a weight"):
        if "input_layernorm" in name:  # a norm of a tiny model: written inline
            raise ZeroDivisionError("a bug")
        real(rows, out, plus_one, name)

    real = builder.convert_into
    monkeypatch.setattr(builder, "convert_into", convert_into)
    with pytest.raises(ir.serde.SerdeError) as raised:
        compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama", 1),
                                       output=tmp_path / "b", max_seq_len=64), show_progress=False)
    chain = [raised.value]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    assert isinstance(chain[-1], ZeroDivisionError), chain


@pytest.mark.parametrize("max_seq_len", [0, -5, 1])
def test_a_context_too_short_to_generate_is_refused_before_anything_is_written(max_seq_len, checkpoints, tmp_path):
    with pytest.raises(SpecbuildError, match="max_seq_len must be a whole number, 2 or more"):
        compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama"), output=tmp_path / "b",
                                       max_seq_len=max_seq_len), show_progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("overwrite, says", [(False, "already holds a specbuild bundle"),
                                              (True, "exists and is not a specbuild bundle")],
                         ids=["a-bundle-without-overwrite", "a-folder-of-notes"])
def test_an_output_compile_may_not_replace_is_refused_before_a_checkpoint_loads(checkpoints, tmp_path, monkeypatch,
                                                                                overwrite, says):
    """It was refused once the staging folder was taken, after both checkpoints had loaded (7 s at 0.6B)."""
    from specbuild.compile import pipeline
    from specbuild.errors import OutputError
    from specbuild_runtime.manifest import FORMAT, MANIFEST

    out = tmp_path / "out"
    out.mkdir()
    if not overwrite:
        (out / MANIFEST).write_text(json.dumps({"format": FORMAT}))
    (out / "notes.txt").write_text("keep me")
    loaded = []
    monkeypatch.setattr(pipeline, "load_checkpoint", lambda *args: loaded.append(args))
    with pytest.raises(OutputError, match=says):
        compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints("llama", 1), output=out,
                                       overwrite=overwrite), show_progress=False)
    assert loaded == [] and (out / "notes.txt").read_text() == "keep me"


def test_the_default_context_stops_at_the_drafts_positions_and_the_manifest_records_the_pairs_limit(checkpoints,
                                                                                                     tmp_path):
    """A draft of fewer positions than the default context (min(2048, the target's 512)) made a compile without
    --max-seq-len fail, asking for one; the runtime's advice on a too-long prompt stops at the recorded limit."""
    manifest = compile_bundle(CompileSettings(target=checkpoints("llama"), draft=checkpoints(
        "llama", 1, max_position_embeddings=128), output=tmp_path / "b", quality_report=False), show_progress=False)
    assert manifest.max_seq_len == manifest.context_limit == 128
    assert SpeculativeDecoder(tmp_path / "b").manifest.context_limit == 128


@pytest.mark.parametrize("architecture, quantize, gathered", [
    ("llama", "none", ["model.embed_tokens.weight"]),  # untied: the LM head is a table of its own
    ("llama", "int4", ["model.embed_tokens.weight"]),  # GatherBlockQuantized: data, scales, zero points
    ("llama3", "none", []),  # tied: the LM head reads the whole table
    ("llama3", "int4", []),  # tied: the head's MatMulNBits reads the lookup's table through a Reshape
    ("gpt2", "none", ["transformer.wpe.weight"]),  # tied wte; learned positions are gathered
])
def test_read_bytes_leave_out_the_tables_a_call_only_gathers_rows_from(architecture, quantize, gathered, checkpoints,
                                                                       tmp_path):
    """A memory-bound call reads all its weights but these: the bandwidth bench measures against read_bytes."""
    ckpt = checkpoints(architecture)
    manifest = compile_bundle(CompileSettings(target=ckpt, draft=ckpt, output=tmp_path / "b", max_seq_len=64,
                                              quantize=quantize), show_progress=False)
    info = manifest.engines["target"]
    model = onnx.load(str(tmp_path / "b" / info.file), load_external_data=False)
    sizes = {t.name: dict((e.key, e.value) for e in t.external_data) for t in model.graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL}
    expected = sum(int(where["length"]) for name, where in sizes.items() if any(name.startswith(g) for g in gathered))
    assert (expected > 0) == bool(gathered)
    assert info.weight_bytes - info.read_bytes == expected


LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
                   "message['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + message['content'].strip() + ' ' + "
                   "eos_token }}{% endif %}{% endfor %}")


def llama2_layout_checkpoint(folder):
    """A tiny llama whose tokenizer files are laid out as Llama 2's ship: a byte-fallback BPE whose normalizer
    prepends and writes spaces as "▁" (no pre-tokenizer), "legacy": false and LlamaTokenizer in
    tokenizer_config.json. transformers 5 reads these files otherwise than tokenizers alone does (a Metaspace
    that prepends to the first piece only, and no second "▁" before a leading space)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    tokenizer.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)]))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    make_checkpoint(folder, "llama", tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                                                eos_token="</s>", unk_token="<unk>"))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))  # as the checkpoint ships it, not as transformers saves it
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False, "legacy": False, "tokenizer_class": "LlamaTokenizer",
        "chat_template": LLAMA2_TEMPLATE}))
    return folder


def test_a_llama_2_tokenizer_encodes_prompts_and_chats_as_transformers_does_on_the_checkpoint(tmp_path):
    """The reference is transformers on the checkpoint's own folder, not on the bundle's tokenizer: a bundle
    holding the checkpoint's tokenizer.json as it is would encode " x" and every "<s>[INST]" otherwise."""
    from specbuild_runtime.serve.chat import load_chat_template

    target = llama2_layout_checkpoint(tmp_path / "target")
    compile_bundle(CompileSettings(target=target, draft=target, output=tmp_path / "b", max_seq_len=64), show_progress=False)
    reference, decoder = tf.AutoTokenizer.from_pretrained(target), SpeculativeDecoder(tmp_path / "b")
    for text in [PROMPTS[1], " " + PROMPTS[1], "  x", "<s>import os", "x</s> y", "\n" + PROMPTS[0], ""]:
        assert decoder.encode(text) == reference(text)["input_ids"], text
    chat = load_chat_template(tmp_path / "b" / "tokenizer")
    for messages in ([{"role": "user", "content": "import os"}],
                     [{"role": "user", "content": " x "}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}]):
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert chat.prompt_ids(decoder.tokenizer, messages) == list(expected)
