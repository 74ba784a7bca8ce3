"""engine/rollout/tokenizer_cache.py: the built-in engine's tokenizer from the entry transformers' tokenizer left
answers every call the engine makes as transformers' does, is used without importing transformers, and is never
used for other files, another release, a damaged entry or a tokenizer whose calls are not the Rust ones."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from engine.config.data import BUNDLED_MODEL, PROJECT_ROOT
from engine.modeling import load_tokenizer
from engine.rollout import tokenizer_cache

MODELS = [BUNDLED_MODEL, str(PROJECT_ROOT / "examples" / "tiny-qwen2-calc")]
TEXTS = ["12+7=", "<|im_start|>user\nWhat is 3*4?<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|im_end|>",
         " héllo  wörld\n\n\t 日本語 🙂 ", "", "   ", "a" * 200, "12 + 7 = 19.<|im_end|><|im_end|>",
         "\r\n\u00a0x"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tokenizer_cache.cache_dir()


@pytest.mark.parametrize("model", MODELS)
def test_the_cached_tokenizer_answers_as_transformers(cache, model):
    hf = load_tokenizer(model)  # leaves the entry
    assert len(list(cache.glob("*.json"))) == 1
    cached = tokenizer_cache.load(model)
    assert isinstance(cached, tokenizer_cache.CachedTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert cached(text, add_special_tokens=special)["input_ids"] == \
                hf(text, add_special_tokens=special)["input_ids"], (text, special)
    rng = random.Random(0)
    special_ids = [hf.eos_token_id, hf.pad_token_id, *hf.all_special_ids]
    for _ in range(400):
        ids = [rng.choice(special_ids) if rng.random() < 0.2 else rng.randrange(len(hf))
               for _ in range(rng.randrange(0, 24))]
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert cached.decode(hf.eos_token_id) == hf.decode(hf.eos_token_id)
    for name in ("eos_token", "pad_token", "bos_token", "eos_token_id", "pad_token_id", "bos_token_id"):
        assert getattr(cached, name) == getattr(hf, name), name
    assert len(cached) == len(hf)
    # anything else is transformers' own tokenizer's, loaded on first use (a caller rendering a chat template)
    assert cached._full is None
    messages = [{"role": "user", "content": "12+7="}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert cached.all_special_ids == hf.all_special_ids and cached._full is not None
    assert cached(["1+1=", "2+2="])["input_ids"] == hf(["1+1=", "2+2="])["input_ids"]  # a batch: transformers'
    assert cached.decode([[5, 6], [7]]) == hf.decode([[5, 6], [7]])


def test_an_engine_reads_it_without_importing_transformers(cache, tmp_path):
    load_tokenizer(BUNDLED_MODEL)
    code = ("import sys; from engine.rollout.tokenizer_cache import engine_tokenizer; "
            f"t = engine_tokenizer({BUNDLED_MODEL!r}); "
            "print(type(t).__name__, 'transformers' in sys.modules, t('1+1=')['input_ids'])")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=PROJECT_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    name, imported, ids = out.stdout.split(" ", 2)
    assert (name, imported) == ("CachedTokenizer", "False")
    assert json.loads(ids) == load_tokenizer(BUNDLED_MODEL)("1+1=")["input_ids"]
    # without an entry: transformers' tokenizer, which leaves one
    shutil.rmtree(cache)
    assert type(tokenizer_cache.engine_tokenizer(BUNDLED_MODEL)).__name__ != "CachedTokenizer"
    assert isinstance(tokenizer_cache.load(BUNDLED_MODEL), tokenizer_cache.CachedTokenizer)


def test_changed_files_or_another_release_are_another_entry(cache, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, model)
    load_tokenizer(str(model))
    assert tokenizer_cache.load(str(model)) is not None
    config = model / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 4096}))
    assert tokenizer_cache.load(str(model)) is None  # the entry of the old files is not this one
    load_tokenizer(str(model))
    assert len(list(cache.glob("*.json"))) == 2
    real = tokenizer_cache.metadata.version
    monkeypatch.setattr(tokenizer_cache.metadata, "version",
                        lambda pkg: "99.0" if pkg == "transformers" else real(pkg))
    assert tokenizer_cache.load(str(model)) is None


def test_a_damaged_entry_is_removed_and_transformers_loads(cache, caplog):
    load_tokenizer(BUNDLED_MODEL)
    (entry,) = cache.glob("*.json")
    entry.write_text('{"format": 1, "key": "')
    assert tokenizer_cache.load(BUNDLED_MODEL) is None
    assert not entry.exists()
    assert "unreadable" in caplog.text
    load_tokenizer(BUNDLED_MODEL)
    body = json.loads(entry.read_text())
    entry.write_text(json.dumps({**body, "backend": "{}"}))  # parses, but no Rust tokenizer
    assert tokenizer_cache.load(BUNDLED_MODEL) is None
    assert not entry.exists()
    assert "unusable" in caplog.text


def test_tokenizers_whose_calls_are_not_the_rust_ones_are_not_kept(cache):
    hf = load_tokenizer(BUNDLED_MODEL)
    assert tokenizer_cache.why_not_kept(hf) is None
    shutil.rmtree(cache)

    class Custom(type(hf)):
        def _decode(self, *a, **k):
            return super()._decode(*a, **k).upper()

    custom = Custom.from_pretrained(BUNDLED_MODEL)
    assert "overrides _decode" in tokenizer_cache.why_not_kept(custom)
    assert tokenizer_cache.remember(BUNDLED_MODEL, custom) is False
    hf.clean_up_tokenization_spaces = True
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert "clean_up_tokenization_spaces" in tokenizer_cache.why_not_kept(hf)
    assert tokenizer_cache.remember(BUNDLED_MODEL, hf) is False
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_a_native_model_syncs_without_transformers_conversion_code():
    """engine/weights/layout.py: rollflow's own model code keeps the checkpoint's names, so a sync from it neither
    converts nor imports transformers.core_model_loading (which imports accelerate)."""
    code = ("import sys, torch; from engine.modeling import load_causal_lm, impl_of; "
            "from engine.weights.layout import checkpoint_state, served_targets; "
            f"m = load_causal_lm({BUNDLED_MODEL!r}); s = m.state_dict(); "
            "assert checkpoint_state(m, s) is s; t, owner = served_targets(m); assert owner == {}; "
            "print(impl_of(m), 'transformers.core_model_loading' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["native", "False"]


def test_the_engine_serves_the_same_answers_from_the_cached_tokenizer(cache):
    """The built-in engine's answers over its HTTP API (text in; ids, log-probs and text out, special tokens kept
    and skipped) are the same with the cached tokenizer as with transformers'."""
    import httpx

    from tests.conftest import served_engine

    body = {"text": ["12+7=", "<|im_start|>user\n3*4=<|im_end|>\n"], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 7}}

    def answers() -> tuple[str, list]:
        with served_engine(BUNDLED_MODEL, max_new_tokens=8) as (state, url):
            out = []
            for skip in (True, False):
                r = httpx.post(url + "/generate", json={**body, "sampling_params": {
                    **body["sampling_params"], "skip_special_tokens": skip}}, timeout=60).json()
                out.append([(a["text"], a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in r])
            return type(state.tokenizer).__name__, out

    load_tokenizer(BUNDLED_MODEL)
    cached_name, cached = answers()
    shutil.rmtree(cache)
    name, plain = answers()
    assert (cached_name, name) == ("CachedTokenizer", "Qwen2Tokenizer")
    assert cached == plain
