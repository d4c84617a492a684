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


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None))


def stream(tok, output_ids, chunk=1, prompt_ids=(), skip_special_tokens=True, strategy="auto"):
    """Feed ``output_ids`` ``chunk`` at a time; returns (deltas, flushed text)."""
    d = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens, strategy=strategy)
    deltas = [d.add_tokens(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    return deltas, d.flush()


def single_byte_token(tok, byte: int) -> int | None:
    """The id of the vocabulary token that is exactly one raw byte (GPT-2 byte
    alphabet), or None: this vocabulary lacks a few bytes that never occur in
    UTF-8 text."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    unprintable = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + unprintable.index(byte))
    return tok.hf_tokenizer.get_vocab().get(char)


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
def test_flush_releases_an_incomplete_character_as_decode_does(tok, strategy):
    ids = tok.encode("ok 你")[:-1]  # the last byte of 你 never arrives
    assert tok.convert_ids_to_tokens(ids) == ["ok", "Ġ", "ä½"]
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert (deltas, tail) == (["ok", " ", ""], FFFD)
    assert "".join(deltas) + tail == tok.decode(ids) == "ok " + FFFD


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_added_token_splits_an_incomplete_character(tok, strategy):
    # tokenizers decodes the bytes on each side of a kept added token separately.
    e4, bd, a0 = (single_byte_token(tok, b) for b in (0xE4, 0xBD, 0xA0))
    ids = [e4, 1, bd, a0, e4, bd, a0]
    for skip, expected in [(False, FFFD + "<|im_start|>" + FFFD * 2 + "你"), (True, "你你")]:
        deltas, tail = stream(tok, ids, skip_special_tokens=skip, strategy=strategy)
        assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip) == expected


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_out_of_vocabulary_ids_decode_to_nothing(tok, strategy):
    ids = tok.encode("a b") + [tok.vocab_size, 2**31] + tok.encode(" c")
    deltas, tail = stream(tok, ids, strategy=strategy)
    assert "".join(deltas) + tail == tok.decode(ids) == "a b c"


def test_every_single_token_decodes_like_the_tokenizer(tok):
    for skip in (True, False):
        for token_id in range(tok.vocab_size):
            d = IncrementalDetokenizer(tok, [], skip)
            assert d.add_tokens([token_id]) + d.flush() == tok.decode([token_id], skip)


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
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)


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
