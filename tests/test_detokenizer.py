"""Incremental detokenization and stop strings on the default model's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tandem.engine.model.model_files import resolve_model
from tandem.engine.text.tokenizer import Tokenizer

STRATEGIES = ["bytes", "window"]
FFFD = "\ufffd"
C07_TEXT = "你好，世界 🎉👍🏽🇯🇵"
# The tracker's reproduction: greedy, max_tokens 40 ends after the first two of
# 👍's four bytes (decode shows them as U+FFFD).
CUT_PROMPT = "你好，世界 🎉👍🏽🇯🇵\n" * 6
CUT_ANSWER = "你好，世界 🎉👍🏽🇯🇵\n你好，世界 🎉"

_PRINTABLE = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
              + list(range(ord("®"), ord("ÿ") + 1)))
# GPT-2's byte alphabet: the character that stands for each byte in the vocabulary.
BYTE_CHAR = {b: chr(b) if b in _PRINTABLE else chr(256 + [x for x in range(256)
                                                         if x not in _PRINTABLE].index(b))
             for b in range(256)}
CHAR_BYTE = {c: b for b, c in BYTE_CHAR.items()}


def _proper_prefixes() -> frozenset[bytes]:
    """Every proper prefix of the UTF-8 encoding of a Unicode scalar value. The
    prefix of a k-byte sequence fixes all but its last 6 bits, so one code point
    per 64 reaches them all."""
    out = set()
    for lo, hi in ((0x80, 0x800), (0x800, 0x10000), (0x10000, 0x110000)):
        for cp in range(lo, hi, 64):
            if 0xD800 <= cp < 0xE000:
                continue  # surrogates have no UTF-8
            enc = chr(cp).encode("utf-8")
            out.update(enc[:k] for k in range(1, len(enc)))
    return frozenset(out)


PROPER_PREFIXES = _proper_prefixes()


def last_run_bytes(tok, ids, skip_special_tokens=True) -> bytes:
    """The raw bytes after the last added token that stays in the text (decode
    renders each run of vocabulary bytes on its own)."""
    added = tok.hf_tokenizer.added_tokens_decoder
    run = bytearray()
    for token_id, token in zip(ids, tok.convert_ids_to_tokens(ids)):
        if token_id in added:
            if not (added[token_id].special and skip_special_tokens):
                run.clear()
        elif token is not None:
            run += bytes(CHAR_BYTE[c] for c in token)
    return bytes(run)


def without_cut_character(tok, ids, skip_special_tokens=True) -> str:
    """``decode(ids)`` minus the U+FFFD that stands for a character cut short at
    the end: the text a finished sample must have."""
    decoded = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    tail = last_run_bytes(tok, ids, skip_special_tokens)
    if any(tail[-k:] in PROPER_PREFIXES for k in (1, 2, 3) if len(tail) >= k):
        assert decoded.endswith(FFFD)
        return decoded[:-1]
    return decoded


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None))


def stream(tok, output_ids, chunk=1, prompt_ids=(), skip_special_tokens=True, strategy="auto"):
    """Feed ``output_ids`` ``chunk`` at a time; returns (deltas, flushed text)."""
    d = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens, strategy=strategy)
    deltas = [d.add_tokens(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    return deltas, d.flush()


_VOCABS: dict = {}  # tokenizer -> its vocabulary


def single_byte_token(tok, byte: int) -> int | None:
    """The id of the vocabulary token that is exactly one raw byte (GPT-2 byte
    alphabet), or None: this vocabulary lacks a few bytes that never occur in
    UTF-8 text."""
    if tok not in _VOCABS:
        _VOCABS[tok] = tok.hf_tokenizer.get_vocab()  # ~0.05 s a call: once per tokenizer
    return _VOCABS[tok].get(BYTE_CHAR[byte])


# --- multi-byte characters (C07) -------------------------------------------------

def test_c07_bytes_strategy_emits_whole_characters_only(tok):
    ids = tok.encode(C07_TEXT)
    deltas, tail = stream(tok, ids, strategy="bytes")
    assert len(ids) == 25  # most characters span 2-4 tokens
    assert [d for d in deltas if d] == ["你", "好", "，", "世", "界", " ", "🎉", "👍", "🏽", "🇯", "🇵"]
    assert tail == ""
    assert "".join(deltas) == tok.decode(ids) == C07_TEXT


def test_c07_window_strategy_emits_whole_characters_only(tok):
    ids = tok.encode(C07_TEXT)
    deltas, tail = stream(tok, ids, prompt_ids=tok.encode("Repeat after me:"), strategy="window")
    # The space shares a token with the emoji's first bytes, so it waits for it.
    assert [d for d in deltas if d] == ["你", "好", "，", "世", "界", " 🎉", "👍", "🏽", "🇯", "🇵"]
    assert tail == ""
    assert "".join(deltas) == C07_TEXT


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_multibyte_text_in_chunks(tok, strategy, chunk):
    text = "Ünïcödé — «ταυτότητα» ✓ 漢字かなカナ 한국어 👩‍👩‍👧‍👦 🏳️‍🌈 end"
    ids = tok.encode(text)
    deltas, tail = stream(tok, ids, chunk=chunk, strategy=strategy)
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids) == text


def test_auto_picks_the_byte_strategy_for_the_default_model(tok):
    ids = tok.encode(C07_TEXT)
    assert stream(tok, ids) == stream(tok, ids, strategy="bytes")


# --- spaces (C08) ----------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_c08_spaces_survive_token_by_token(tok, strategy):
    text = (" The ocean covers  71% of Earth's surface,\tholding 97% of its water.\n\n"
            "  Waves   crash ; tides turn .  ")
    ids = tok.encode(text)
    deltas, tail = stream(tok, ids, prompt_ids=tok.encode("Write one sentence about the ocean."),
                          strategy=strategy)
    assert "".join(deltas) + tail == text
    assert deltas[:4] == [" The", " ocean", " covers", " "]


# --- special tokens, incomplete sequences, invalid bytes ----------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_special_tokens_skipped_or_kept(tok, strategy):
    im_end, im_start = 2, 1
    ids = tok.encode("Hi there") + [im_end, im_start] + tok.encode("assistant\nYes")
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert "".join(deltas) + tail == "Hi thereassistant\nYes"
    deltas, tail = stream(tok, ids, skip_special_tokens=False, strategy=strategy)
    assert "".join(deltas) + tail == "Hi there<|im_end|><|im_start|>assistant\nYes"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flush_drops_an_incomplete_trailing_character(tok, strategy):
    ids = tok.encode("ok 你")[:-1]  # the last byte of 你 never arrives
    assert tok.convert_ids_to_tokens(ids) == ["ok", "Ġ", "ä½"]
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert (deltas, tail) == (["ok", " ", ""], "")
    assert tok.decode(ids) == "ok " + FFFD     # decode shows the cut 你 as U+FFFD
    # The end-of-sequence token after it (skipped) does not change that.
    deltas, tail = stream(tok, ids + [tok.eos_token_id], strategy=strategy)
    assert "".join(deltas) + tail == "ok "


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_generated_replacement_character_is_kept(tok, strategy):
    real = tok.encode("ok \ufffd")        # U+FFFD as a character: EF BF BD, one token
    assert tok.convert_ids_to_tokens(real) == ["ok", "Ġ", "ï¿½"]
    e4 = single_byte_token(tok, 0xE4)
    for ids, text in [(real, "ok " + FFFD),
                      (real + [e4], "ok " + FFFD),          # then a cut character: dropped
                      (real + [e4, tok.encode("a")[0]], "ok " + FFFD * 2 + "a")]:
        deltas, tail = stream(tok, ids, strategy=strategy)
        assert "".join(deltas) + tail == text == without_cut_character(tok, ids)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invalid_bytes_at_the_end_still_decode_as_replacement(tok, strategy):
    # Not a cut character but bytes no character starts with: as decode renders them.
    a = tok.encode("a")[0]
    for tail_bytes in ([0x80], [0xBD, 0xA0], [0xED, 0xA0], [0xE0, 0x80], [0xF4, 0x90]):
        ids = [a] + [single_byte_token(tok, b) for b in tail_bytes]
        decoded = tok.decode(ids)
        assert decoded.startswith("a" + FFFD)
        deltas, tail = stream(tok, ids, strategy=strategy)
        assert "".join(deltas) + tail == decoded, tail_bytes
    # A surrogate's would-be prefix ED 9F *is* a character's (U+D7FF): dropped.
    ids = [a] + [single_byte_token(tok, b) for b in (0xED, 0x9F)]
    assert tok.decode(ids) == "a" + FFFD
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert "".join(deltas) + tail == "a"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_added_token_splits_an_incomplete_character(tok, strategy):
    # tokenizers decodes the bytes on each side of a kept added token separately.
    e4, bd, a0 = (single_byte_token(tok, b) for b in (0xE4, 0xBD, 0xA0))
    ids = [e4, 1, bd, a0, e4, bd, a0]
    for skip, expected in [(False, FFFD + "<|im_start|>" + FFFD * 2 + "你"), (True, "你你")]:
        deltas, tail = stream(tok, ids, skip_special_tokens=skip, strategy=strategy)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip) == expected
    # A character cut by a kept added token is in the middle of the text: as decode.
    ids = tok.encode("ok") + [e4, bd, 2]
    for skip, expected in [(False, "ok" + FFFD + "<|im_end|>"), (True, "ok")]:
        deltas, tail = stream(tok, ids, skip_special_tokens=skip, strategy=strategy)
        assert "".join(deltas) + tail == expected == without_cut_character(tok, ids, skip)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_of_vocabulary_ids_decode_to_nothing(tok, strategy):
    ids = tok.encode("a b") + [tok.vocab_size, 2**31] + tok.encode(" c")
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert "".join(deltas) + tail == tok.decode(ids) == "a b c"


def test_every_single_token_decodes_like_the_tokenizer(tok):
    # ... except a token that is only the start of a character: decode shows U+FFFD,
    # a finished sample nothing.
    cut = {True: set(), False: set()}
    for skip in (True, False):
        for token_id in range(tok.vocab_size):
            d = IncrementalDetokenizer(tok, [], skip)
            text = d.add_tokens([token_id]) + d.flush()
            assert text == without_cut_character(tok, [token_id], skip)
            if text != tok.decode([token_id], skip):
                cut[skip].add(token_id)
    assert cut[True] == cut[False] and len(cut[True]) == 239
    assert {"ä½", "ðŁ", "ĠðŁ"} <= set(tok.convert_ids_to_tokens(sorted(cut[True])))


def test_add_after_flush_is_an_error(tok):
    d = IncrementalDetokenizer(tok, [])
    assert d.add_tokens(tok.encode("hi")) == "hi"
    assert (d.flush(), d.finished, d.flush()) == ("", True, "")
    with pytest.raises(RuntimeError, match="after flush"):
        d.add_tokens([42])


def test_unknown_strategy_is_refused(tok):
    with pytest.raises(ValueError, match="strategy"):
        IncrementalDetokenizer(tok, [], strategy="fast")


# --- properties ----------------------------------------------------------------------

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY_SETTINGS
@given(text=st.text(max_size=60), chunk=st.integers(1, 4), strategy=st.sampled_from(STRATEGIES))
def test_property_text_streams_back_unchanged(tok, text, chunk, strategy):
    ids = tok.encode(text)
    decoded = tok.decode(ids)
    deltas, tail = stream(tok, ids, chunk=chunk, strategy=strategy)
    assert "".join(deltas) + tail == decoded
    # Characters whose bytes are missing from the vocabulary (e.g. U+40000)
    # legitimately decode to U+FFFD; everything else must never show one.
    if FFFD not in decoded:
        assert all(FFFD not in d for d in deltas + [tail])


@pytest.fixture(scope="module")
def raw_byte_ids(tok) -> list[int]:
    """Ids of the single-byte tokens: free to form invalid UTF-8."""
    ids = [single_byte_token(tok, b) for b in range(256)]
    assert sum(i is not None for i in ids) > 200
    return [i for i in ids if i is not None]


@PROPERTY_SETTINGS
@given(data=st.data(), chunk=st.integers(1, 3), skip=st.booleans(),
       strategy=st.sampled_from(STRATEGIES))
def test_property_any_ids_concatenate_to_decode(tok, raw_byte_ids, data, chunk, skip, strategy):
    token_id = st.one_of(st.sampled_from(raw_byte_ids), st.integers(0, 16),
                         st.integers(0, tok.vocab_size - 1), st.integers(tok.vocab_size, 2**32 - 1))
    ids = data.draw(st.lists(token_id, max_size=24))
    deltas, tail = stream(tok, ids, chunk=chunk, skip_special_tokens=skip, strategy=strategy)
    assert "".join(deltas) + tail == without_cut_character(tok, ids, skip_special_tokens=skip)


# Characters of several bytes and tokens: CJK, kana, hangul, accents, emoji with
# skin tones, ZWJ families, flags, a variation selector, a 4-byte CJK/musical symbol.
GRAPHEMES = ["你", "好", "，", "世", "界", "漢", "字", "か", "カ", "한", "é", "ß", "𝄞", "𠀋",
             "🎉", "👍🏽", "👩‍👩‍👧‍👦", "👨🏿‍💻", "🏳️‍🌈", "❤️", "🇯🇵", "🇫🇷", "🇺🇦",
             " ", "a", "\n", "—"]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(GRAPHEMES), min_size=1, max_size=12),
       chunk=st.integers(1, 3), strategy=st.sampled_from(STRATEGIES))
def test_property_cut_anywhere_never_ends_in_replacement(tok, parts, chunk, strategy):
    full = "".join(parts)
    ids = tok.encode(full)
    assert tok.decode(ids) == full
    for k in range(len(ids) + 1):          # a sample ended after every token count
        deltas, tail = stream(tok, ids[:k], chunk=chunk, strategy=strategy)
        text = "".join(deltas) + tail
        assert all(FFFD not in d for d in deltas + [tail]), (k, deltas, tail)
        one_shot = stream(tok, ids[:k], chunk=max(k, 1), strategy=strategy)  # not streamed
        assert "".join(one_shot[0]) + one_shot[1] == text
        assert full.startswith(text)
        assert text == without_cut_character(tok, ids[:k])


# --- stop strings --------------------------------------------------------------------

def match_stream(matcher: StopStringMatcher, deltas):
    """Feed deltas until a match; returns (emitted per step, matched, flushed)."""
    emitted = []
    for delta in deltas:
        text, matched = matcher.process(delta)
        emitted.append(text)
        if matched is not None:
            return emitted, matched, matcher.flush()
    return emitted, None, matcher.flush()


def test_c03_stop_string_spanning_several_tokens(tok):
    ids = tok.encode(" L M N O P Q R S T")
    d = IncrementalDetokenizer(tok, tok.encode("A B C D E F G H I J K"))
    deltas = [d.add_tokens([i]) for i in ids]
    assert deltas[:6] == [" L", " M", " N", " O", " P", " Q"]
    emitted, matched, tail = match_stream(StopStringMatcher(["O P Q"]), deltas)
    # " O" could start the stop string: its "O" is held back, then dropped.
    assert emitted == [" L", " M", " N", " ", "", ""]
    assert (matched, tail) == ("O P Q", "")
    whole = StopStringMatcher(["O P Q"]).process("".join(deltas))
    assert whole == (" L M N ", "O P Q") == ("".join(emitted), matched)


def test_c03_include_stop_str_in_output(tok):
    deltas = [" L", " M", " N", " O", " P", " Q", " R"]
    emitted, matched, _ = match_stream(StopStringMatcher(["O P Q"], True), deltas)
    assert emitted == [" L", " M", " N", " ", "", "O P Q"]
    assert matched == "O P Q"
    assert StopStringMatcher(["O P Q"], True).process("".join(deltas)) == (" L M N O P Q", "O P Q")


def test_c04_partial_match_pending_at_the_end_is_flushed():
    stop = ["\n", "Alice:"]
    deltas = [" Nice", " to", " meet", " you", ".", " A", "lice"]  # max_tokens hit
    emitted, matched, tail = match_stream(StopStringMatcher(stop), deltas)
    assert emitted == [" Nice", " to", " meet", " you", ".", " ", ""]
    assert (matched, tail) == (None, "Alice")
    assert "".join(emitted) + tail == " Nice to meet you. Alice"
    m = StopStringMatcher(stop)
    assert (m.process("".join(deltas)), m.flush()) == ((" Nice to meet you. ", None), "Alice")


def test_c04_held_text_is_released_exactly_once():
    stop = ["\n", "Alice:"]
    deltas = [" Al", "ic", "e", " and", " Alice", " left", "\n", "Bob"]
    emitted, matched, tail = match_stream(StopStringMatcher(stop), deltas)
    assert emitted == [" ", "", "", "Alice and", " ", "Alice left", ""]
    assert (matched, tail) == ("\n", "")
    assert "".join(emitted) == " Alice and Alice left"


def test_stop_string_spanning_several_deltas_with_multibyte_text(tok):
    ids = tok.encode(C07_TEXT + " done")
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.add_tokens([i]) for i in ids] + [d.flush()]
    emitted, matched, _ = match_stream(StopStringMatcher(["🇯🇵"]), deltas)
    assert "".join(emitted) == "你好，世界 🎉👍🏽"
    assert matched == "🇯🇵"


def test_overlapping_stop_strings_first_completed_wins():
    for stop in (["abcd", "bc"], ["bc", "abcd"]):
        assert StopStringMatcher(stop).process("xabcdy") == ("xa", "bc")
        emitted, matched, _ = match_stream(StopStringMatcher(stop), list("xabcdy"))
        assert ("".join(emitted), matched) == ("xa", "bc")
    # Both end at the same character: the longer one, which started earlier.
    assert StopStringMatcher(["b", "ab"]).process("xaby") == ("x", "ab")
    assert StopStringMatcher(["b", "ab"], True).process("xaby") == ("xab", "ab")


def test_held_tail_shrinks_as_candidates_fail():
    m = StopStringMatcher(["aab"])
    assert [m.process(c) for c in "aaa"] == [("", None), ("", None), ("a", None)]
    assert m.process("b") == ("", "aab")


def test_no_stop_strings_pass_text_through():
    m = StopStringMatcher([])
    assert [m.process(c) for c in ("ab", "", "c")] == [("ab", None), ("", None), ("c", None)]
    assert m.flush() == ""


def test_matcher_errors():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["x", ""])
    m = StopStringMatcher("x")
    assert (m.process("axb"), m.finished, m.matched) == (("a", "x"), True, "x")
    with pytest.raises(RuntimeError):
        m.process("more")
    assert m.flush() == ""


def reference_stop(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the first end position where some stop string ends, longest first."""
    for end in range(1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end if include else end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab c\n", max_size=30),
       stop=st.lists(st.text("ab c\n", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8), include=st.booleans())
def test_property_streaming_equals_one_shot_and_reference(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, matched, tail = match_stream(StopStringMatcher(stop, include), deltas)
    one_shot, one_matched, one_tail = match_stream(StopStringMatcher(stop, include), [text])
    expected = reference_stop(text, stop, include)
    assert ("".join(emitted) + tail, matched) == ("".join(one_shot) + one_tail, one_matched)
    assert ("".join(emitted) + tail, matched) == expected
    if not include:
        assert not any(s in expected[0] for s in stop)


# --- a sample ended inside a character: the offline engine, a byte-fallback tokenizer ---

@pytest.mark.slow
def test_greedy_answer_cut_inside_a_character_ends_whole(f32_weights):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling.sampling_params import SamplingParams

    llm = LLM(dtype="float32", num_blocks=32, weights_from=f32_weights)
    tok = llm.tokenizer
    # A stop string whose start ("🎉") is held back at the end and then released.
    [out] = llm.generate(CUT_PROMPT, SamplingParams(temperature=0, max_tokens=40,
                                                    stop=["🎉!"]))[0].outputs
    assert (out.finish_reason, len(out.token_ids)) == ("length", 40)
    assert tok.convert_ids_to_tokens(out.token_ids[-1:]) == ["ðŁ"]   # 👍's F0 9F
    assert tok.decode(out.token_ids) == CUT_ANSWER + FFFD
    assert out.text == CUT_ANSWER == without_cut_character(tok, out.token_ids)


@pytest.fixture(scope="module")
def byte_fallback_tok(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama 2's decoder: metaspace, byte
    fallback, one U+FFFD per byte of an invalid run): the window strategy's kind."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from tandem.engine.model.model_files import ModelFiles

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "你", FFFD]:
        vocab[piece] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True,
                                  unk_token="<unk>", fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    path = tmp_path_factory.mktemp("byte_fallback_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return Tokenizer(ModelFiles(str(path), "hf", "byte-fallback"))


def test_byte_fallback_cut_anywhere_ends_whole(byte_fallback_tok):
    tok = byte_fallback_tok
    ids = tok.encode("a 你好 🎉 b" + FFFD, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == [
        "▁", "a", "▁", "你", "<0xE5>", "<0xA5>", "<0xBD>", "▁",
        "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>", "▁", "b", FFFD]
    assert tok.decode(ids[:6]) == "a 你" + FFFD * 2      # decode: one U+FFFD per cut byte
    finals = []
    for k in range(len(ids) + 1):
        deltas, tail = stream(tok, ids[:k])
        assert all(FFFD not in d for d in deltas[:14] + [tail if k < 15 else ""]), k
        finals.append("".join(deltas) + tail)
    assert finals == ["", "", "a", "a ", "a 你", "a 你", "a 你", "a 你好", "a 你好 ",
                      "a 你好 ", "a 你好 ", "a 你好 ", "a 你好 🎉", "a 你好 🎉 ",
                      "a 你好 🎉 b", "a 你好 🎉 b" + FFFD]   # the last: a U+FFFD piece, kept
    f0 = ids[8]
    for more, text in [([f0], "a 你好 🎉 b" + FFFD),           # a generated U+FFFD, then a cut
                       ([3 + 0x80], "a 你好 🎉 b" + FFFD * 2),  # a stray continuation byte
                       ([2], "a 你好 🎉 b" + FFFD)]:            # end of sequence (skipped)
        deltas, tail = stream(tok, ids + more)
        assert "".join(deltas) + tail == text
