"""Tokenizer, chat template and incremental detokenizer (mla_jax/engine/text.py)."""

import json
import random

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mla_jax.engine.text import ChatTemplateError, IncrementalDetokenizer, Tokenizer

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end_of_turn|>"]
CORPUS = [
    "def add(x, y):\n    return x + y\n",
    "class Foo:\n    \"\"\"A docstring with café and naïve.\"\"\"\n    pass\n",
    "for i in range(10):\n    print(i, 'héllo wörld')\n",
]

TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.sys = m['content'] %}"
    "{% elif m['role'] == 'user' %}<user>{{ m['content'] }}{% if ns.sys %}|{{ ns.sys }}{% endif %}"
    "{% elif m['role'] == 'assistant' %}<bot>{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<tool>{{ m['content'] | tojson }}"
    "{% else %}{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)


def _byte_level_bpe(vocab_size=300) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def _write_dir(path, tok, tokenizer_config=None, generation_config=None):
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    return _write_dir(path, _byte_level_bpe(), tokenizer_config={
        "bos_token": {"content": "<|bos|>", "lstrip": False}, "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "add_bos_token": True, "add_eos_token": False, "chat_template": TEMPLATE,
    }, generation_config={"eos_token_id": [1, 3]})


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_from_dir_without_tokenizer_json_is_none(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(tmp_path / "missing")


def test_special_tokens_and_eos_ids(tok):
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1 and tok.pad_token_id == 2
    assert tok.eos_token_ids == (1, 3)  # tokenizer_config's eos first, then generation_config's extra one
    assert tok.vocab_size == tok.backend.get_vocab_size()


def test_encode_adds_bos_once(tok):
    text = "def add(x, y):"
    plain = tok.encode(text, add_special_tokens=False)
    assert plain and 0 not in plain
    assert tok.encode(text) == [0] + plain
    # Text that already starts with the bos token (a rendered chat template) keeps one bos.
    assert tok.encode("<|bos|>" + text) == [0] + plain
    assert tok.encode("") == [0]
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<|bos|>" + text
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError):
        tok.encode([1, 2])


def test_bad_configs_raise(tmp_path):
    (tmp_path / "a").mkdir()
    _write_dir(tmp_path / "a", _byte_level_bpe(), tokenizer_config={"bos_token": "<s>"})
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        Tokenizer.from_dir(tmp_path / "a")
    (tmp_path / "b").mkdir()
    _write_dir(tmp_path / "b", _byte_level_bpe(), tokenizer_config={"add_bos_token": True})
    with pytest.raises(ValueError, match="no bos_token"):
        Tokenizer.from_dir(tmp_path / "b")
    (tmp_path / "c").mkdir()
    _write_dir(tmp_path / "c", _byte_level_bpe(), generation_config={"eos_token_id": "x"})
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_dir(tmp_path / "c")
    (tmp_path / "d").mkdir()
    _write_dir(tmp_path / "d", _byte_level_bpe())
    (tmp_path / "d" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.from_dir(tmp_path / "d")


def test_chat_template_renders(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "tool", "content": {"ok": "é"}},
                {"role": "user", "content": "again"}]
    out = tok.apply_chat_template(messages)
    assert out == ('<|bos|><user>hi|be brief<bot>hello<|eos|><tool>{"ok": "é"}<user>again|be brief<bot>')
    assert tok.apply_chat_template(messages[:2], add_generation_prompt=False) == "<|bos|><user>hi|be brief"
    # Encoding the rendered text keeps a single bos even with add_special_tokens=True.
    ids = tok.encode(out)
    assert ids.count(0) == 1 and ids[0] == 0
    assert tok.encode(out, add_special_tokens=False) == ids
    # Extra keyword variables reach the template; an explicit template overrides the stored one.
    assert tok.apply_chat_template([], chat_template="{{ greeting }}{{ eos_token }}", greeting="yo") == "yo<|eos|>"


def test_chat_template_errors(tok, tmp_path):
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="has no 'role'"):
        tok.apply_chat_template([{"content": "x"}])
    # The sandbox refuses attribute escapes and mutation of the caller's messages.
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages, chat_template="{{ messages.append(1) }}")
    assert messages == [{"role": "user", "content": "x"}]
    _write_dir(tmp_path, _byte_level_bpe())
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_list_form(tmp_path):
    _write_dir(tmp_path, _byte_level_bpe(), tokenizer_config={"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]})
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"


def _random_text(rng: random.Random, n: int) -> str:
    pools = ["abcdef xyz()\n_=:", "éüßñø", "中文字符漢", "😀🐍🚀👍🏽", "\u0301\u200d"]  # 2-, 3-, 4-byte chars
    return "".join(rng.choice(rng.choice(pools)) for _ in range(n))


def _stream(tok, ids):
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    return detok, deltas


def test_detokenizer_holds_back_split_characters(tok):
    ids = tok.encode("x😀", add_special_tokens=False)
    assert len(ids) >= 3, "the emoji should be split over byte tokens in this small vocabulary"
    detok, deltas = _stream(tok, ids)
    assert deltas[0] == "x"
    assert all(d == "" for d in deltas[1:-1])
    assert deltas[-1] == "😀"
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_valid_text(tok, seed):
    rng = random.Random(seed)
    text = _random_text(rng, rng.randint(0, 60))
    ids = tok.encode(text)  # with bos, skipped on decode
    detok, deltas = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text == tok.decode(ids)
    assert detok.flush() == "" and detok.text == text


@pytest.mark.parametrize("seed", range(5))
def test_detokenizer_arbitrary_ids_match_decode(tok, seed):
    # Any id sequence, including invalid UTF-8 and special tokens: pushes + flush == decode(all ids).
    rng = random.Random(100 + seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 80))]
    detok, deltas = _stream(tok, ids)
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids)
    raw = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    skip = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(skip.push(i) for i in ids) + skip.flush() == raw.decode(ids, skip_special_tokens=False)


def test_detokenizer_truncated_stream_flushes_replacement(tok):
    ids = tok.encode("😀", add_special_tokens=False)[:-1]  # stream stopped mid-character
    detok, deltas = _stream(tok, ids)
    assert deltas == [""] * len(ids)
    assert detok.flush() == tok.decode(ids) and "\ufffd" in tok.decode(ids)


def test_detokenizer_metaspace_keeps_spaces(tmp_path):
    # SentencePiece-style decoders drop the leading space of a decode: the window keeps context so it is not lost.
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world foo bar baz"] * 10, trainer)
    _write_dir(tmp_path, tok)
    t = Tokenizer.from_dir(tmp_path)
    ids = t.encode("hello world foo bar")
    detok, deltas = _stream(t, ids)
    assert "".join(deltas) + detok.flush() == t.decode(ids) == "hello world foo bar"
