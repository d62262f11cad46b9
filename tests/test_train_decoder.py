"""scripts/data/train_decoder.py (the decoder with real weights of issue 30) and its accessor
onnxopt.models.trained_decoder, on the --tiny recipe (40 files, a 2-layer 64-wide grouped-query model, 12 steps:
seconds): the folder loads offline with transformers, the tokenizer round-trips Python source, two runs (one in
this process, one a separate `python -m` process) write the same bytes, the recorded held-out perplexity is
finite, better than uniform and is what the saved weights score, and held-out files are disjoint from training
files."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from onnxopt.models import trained_decoder  # noqa: E402
from scripts.data import train_decoder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_SOURCE = ('def f(x: int = 3) -> str:\n'
                 '    """Docstring with unicode: caf\u00e9 \u2192 \u03bb, tabs\tand  two spaces."""\n'
                 "\tif x:\n        return f'{x!r:>10}'  # comment\n    return ''\n\n\nclass A(object):\n    pass\n")


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """The tiny recipe trained twice: in this process and by the command line in another process."""
    base = tmp_path_factory.mktemp("trained")
    first, second = base / "first", base / "second"
    train_decoder.train(train_decoder.tiny_recipe(), first, threads=1, log=lambda *_: None)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.data.train_decoder", "--tiny", "--threads", "1",
                           "--out", str(second)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return first, second


def test_tiny_runs_write_identical_bytes(tiny_runs):
    first, second = tiny_runs
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json",
                 "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    a, b = (json.loads((d / trained_decoder.METADATA_FILE).read_text()) for d in tiny_runs)
    assert a["model_safetensors_sha256"] == b["model_safetensors_sha256"]
    assert a["held_out"] == b["held_out"] and a["training"] == b["training"]


def test_folder_loads_offline_with_transformers(tiny_runs, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = train_decoder.import_transformers()
    import torch

    folder = tiny_runs[0]
    assert not trained_decoder.missing_files(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert cfg.model_type == "llama" and type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    assert cfg.tie_word_embeddings is False
    assert tok.eos_token_id == cfg.eos_token_id == tok.convert_tokens_to_ids(train_decoder.EOT)
    assert tok.pad_token_id == cfg.pad_token_id != cfg.eos_token_id
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    ids = tok("import os\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_python_source(tiny_runs):
    transformers = train_decoder.import_transformers()
    from tokenizers import Tokenizer

    folder = tiny_runs[0]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    corpus = train_decoder.load_corpus(max_files=train_decoder.tiny_recipe().max_files)
    for text in (SAMPLE_SOURCE, corpus.held_out[0][1], corpus.train[-1][1]):
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids  # the transformers wrapper adds no bos/eos and splits the same
        assert tok.decode(ids) == text
        assert raw.decode(ids) == text
    assert len(tok(SAMPLE_SOURCE)["input_ids"]) < len(SAMPLE_SOURCE.encode())  # merges were learned


def test_held_out_perplexity_is_finite_recorded_and_what_the_saved_weights_score(tiny_runs):
    transformers = train_decoder.import_transformers()
    from tokenizers import Tokenizer

    folder = tiny_runs[0]
    meta = trained_decoder.metadata(folder)
    held = meta["held_out"]
    assert math.isfinite(held["perplexity"]) and 1 < held["perplexity"]
    # 12 steps already beat the uniform guess over the vocabulary (ln 384 = 5.95 nats)
    assert held["perplexity"] < 0.8 * meta["recipe"]["vocab_size"]
    assert held["tokens_scored"] > 0 and held["tokens_scored"] % meta["recipe"]["seq_len"] == 0
    assert meta["training"]["last_loss"] < meta["training"]["first_loss"]
    assert meta["seeds"] == {"torch": 1234, "data": 4321} and meta["threads"] == 1
    assert meta["training"]["steps"] == 12 and len(meta["training"]["loss_by_tenth"]) == 10
    assert set(meta["versions"]) >= {"torch", "transformers", "tokenizers", "python"}
    # the saved weights, loaded back, score the recorded number on the held-out stream
    recipe = train_decoder.Recipe(**meta["recipe"])
    corpus = train_decoder.load_corpus(max_files=recipe.max_files)
    assert corpus.list_sha256() == meta["corpus"]["file_list_sha256"]
    ids = train_decoder.token_stream(Tokenizer.from_file(str(folder / "tokenizer.json")),
                                     [t for _, t in corpus.held_out])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    nll, scored = train_decoder.held_out_loss(model, ids, recipe.seq_len, recipe.eval_max_tokens)
    assert scored == held["tokens_scored"]
    assert nll == pytest.approx(held["mean_nll"], abs=1e-4)


def test_held_out_files_are_disjoint_from_training_files(tiny_runs):
    meta = trained_decoder.metadata(tiny_runs[0])
    tiny = train_decoder.load_corpus(max_files=train_decoder.tiny_recipe().max_files)
    assert meta["corpus"]["held_out_files"] == [p for p, _ in tiny.held_out]
    # the whole corpus: split by file, by the fixed rule, about a tenth held out, no test folders
    full = train_decoder.load_corpus()
    train_paths = {p for p, _ in full.train}
    held_paths = {p for p, _ in full.held_out}
    assert train_paths and held_paths and not train_paths & held_paths
    assert all(train_decoder.is_held_out(p) for p in held_paths)
    assert not any(train_decoder.is_held_out(p) for p in train_paths)
    assert 0.05 < len(held_paths) / (len(held_paths) + len(train_paths)) < 0.15
    assert not any({"test", "tests", "site-packages"} & set(Path(p).parts) for p in train_paths | held_paths)
    assert set(p for p, _ in tiny.train) <= train_paths  # the tiny slice splits as the full corpus does


def test_accessor_names_the_command_when_missing_and_finds_a_complete_folder(tiny_runs, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m scripts\.data\.train_decoder"):
        trained_decoder.trained_decoder_dir(cache=tmp_path)
    folder = trained_decoder.default_trained_dir(cache=tmp_path)
    shutil.copytree(tiny_runs[0], folder)
    assert trained_decoder.trained_decoder_dir(cache=tmp_path) == folder
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="lacks tokenizer.json"):
        trained_decoder.trained_decoder_dir(cache=tmp_path)


def test_cli_refuses_bad_steps_with_exit_2():
    assert train_decoder.main(["--steps", "0"]) == 2
    assert train_decoder.main(["--threads", "0", "--tiny"]) == 2


_BUILDER = r"""
import runpy, sys
from onnxopt.models.torchvision_models import skip_meta_registrations
skip_meta_registrations()  # transformers imports torchvision, whose CPU wheel here has no compiled ops
sys.argv = ["builder", "-i", sys.argv[1], "-o", sys.argv[2], "-p", "fp32", "-e", "cpu", "-c", sys.argv[3]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
"""


def test_genai_model_builder_reads_the_folder_and_its_tokenizer_agrees(tiny_runs, tmp_path):
    """onnxruntime-genai's model builder builds a GQA model from the folder, and onnxruntime-genai's own
    tokenizer (onnxruntime-extensions, reading tokenizer.json by its GPT2Tokenizer class) gives the ids that
    the tokenizers library gives, and decodes them back."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from tokenizers import Tokenizer

    folder, out = tiny_runs[0], tmp_path / "genai"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _BUILDER, str(folder), str(out), str(tmp_path / "hf")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "GroupQueryAttention" in {n.op_type for n in onnx.load(out / "model.onnx").graph.node}
    model = og.Model(str(out))
    tok = og.Tokenizer(model)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    corpus = train_decoder.load_corpus(max_files=train_decoder.tiny_recipe().max_files)
    for text in (SAMPLE_SOURCE, corpus.held_out[0][1][:4000]):
        ids = [int(i) for i in tok.encode(text)]
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=24, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(tok.encode("import os\n"))
    while not gen.is_done():
        gen.generate_next_token()
    assert len(gen.get_sequence(0)) == 24
