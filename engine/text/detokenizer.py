"""Incremental detokenization and stop strings for streamed generation.

Shared by the router (one instance pair per streamed sample) and the offline
engine, so streamed and non-streamed text come from the same code. Nothing here
imports gRPC.

Two invariants the tests check on the real tokenizer:

* ``"".join(deltas) + flush()`` equals ``tokenizer.decode(output_ids)`` less
  the U+FFFD that ``decode`` shows for an incomplete character at the very end
  of the bytes (see below), and no delta ever carries half of a multi-byte character (no
  spurious U+FFFD).
* Stop strings cut the text at the same place whether it arrives in one piece
  or in many, and text held back as a possible stop string is released exactly
  once.

The end of a text. A sample can end (max_tokens, a stop token, an abort, any
finish) between two tokens of one character: its last bytes are a proper
prefix of a well-formed UTF-8 sequence (``你`` is E4 BD A0; the text ends after
E4 BD). ``tokenizer.decode`` renders such a tail as U+FFFD (one per byte for a
SentencePiece byte-fallback tokenizer); :meth:`IncrementalDetokenizer.flush`
drops it instead, so the final text is cut to its last complete character and
never ends in a U+FFFD that stands for a cut character (the public API promises
text that never splits a UTF-8 character). The sample's token ids, and so
usage and token counts, still include every token. Only that incomplete tail
goes: bytes that no character can start with (a stray continuation byte, an
encoded surrogate; in the middle or at the end) and a character cut by a kept
added token such as ``<|im_end|>`` still decode to U+FFFD exactly as
``decode`` renders them, and a U+FFFD the model generated itself (the bytes
EF BF BD) is text like any other.
"""

from __future__ import annotations

import codecs
import re
import weakref
from typing import Sequence

from tandem.engine.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher"]

# Prompt tokens decoded as left context by the window strategy. vLLM uses the
# same number: enough for a SentencePiece "▁" prefix to be resolved.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
# SentencePiece's byte-fallback pieces, one raw byte each (tokenizers' ByteFallback).
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_truncated_character(pending: bytes) -> bool:
    """True when ``pending`` (what an incremental UTF-8 decoder still buffers) is
    a proper prefix of a well-formed UTF-8 sequence: a character cut short.

    CPython's decoder also buffers some prefixes that can no longer become a
    character (``ED A0``, the start of an encoded surrogate); those are invalid
    bytes, not a cut character, and decode to more than one U+FFFD under the
    maximal-subpart rule that both CPython and ``tokenizers`` follow.
    """
    return bool(pending) and pending.decode("utf-8", "replace") == _REPLACEMENT_CHAR


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable stand-in of each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


class _ByteVocab:
    """Token id -> raw bytes for a byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM2).

    Mirrors how ``tokenizers`` decodes: a vocabulary token maps each character
    back to its byte (a token with a character outside the byte alphabet
    contributes its own UTF-8 instead); the bytes of consecutive vocabulary
    tokens are joined and decoded with replacement of invalid sequences; an
    added token (e.g. ``<|im_end|>``) is not byte-mapped but inserted verbatim,
    and ends the run of bytes before it, or is dropped entirely when it is
    special and special tokens are skipped. Ids outside the vocabulary decode
    to nothing.
    """

    def __init__(self, tokenizer: Tokenizer):
        backend = tokenizer.hf_tokenizer.backend_tokenizer
        to_byte = _gpt2_unicode_to_byte()
        vocab = backend.get_vocab(with_added_tokens=False)
        self.pieces: list[bytes] = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            try:
                self.pieces[token_id] = bytes(to_byte[c] for c in token)
            except KeyError:
                self.pieces[token_id] = token.encode("utf-8")
        # id -> (text, is_special)
        self.added: dict[int, tuple[str, bool]] = {
            i: (t.content, bool(t.special)) for i, t in backend.get_added_tokens_decoder().items()}

    @staticmethod
    def supports(tokenizer: Tokenizer) -> bool:
        """True when ``tokenizer.decode`` is exactly byte-level decoding."""
        from tokenizers import decoders

        hf = tokenizer.hf_tokenizer
        backend = getattr(hf, "backend_tokenizer", None)
        # Clean-up rewrites spaces around punctuation after decoding, which a
        # byte-exact stream cannot reproduce.
        return (backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
                and not getattr(hf, "clean_up_tokenization_spaces", False))


# Built once per tokenizer (~0.04 s for 49k tokens) and shared by all its
# requests; weak keys let a dropped tokenizer take its table with it.
_BYTE_VOCABS: "weakref.WeakKeyDictionary[Tokenizer, _ByteVocab | None]" = (
    weakref.WeakKeyDictionary())


def _byte_vocab(tokenizer: Tokenizer) -> _ByteVocab | None:
    if tokenizer not in _BYTE_VOCABS:
        _BYTE_VOCABS[tokenizer] = _ByteVocab(tokenizer) if _ByteVocab.supports(tokenizer) else None
    return _BYTE_VOCABS[tokenizer]


class IncrementalDetokenizer:
    """Turns one sample's generated token ids into text deltas as they arrive.

    ``"".join(add_tokens(...) for each step) + flush()`` equals
    ``tokenizer.decode(all_output_ids, skip_special_tokens)`` with a trailing
    incomplete character removed, and a delta never ends inside a multi-byte
    UTF-8 character: the bytes of an incomplete character are held back until
    the tokens that complete it arrive; if generation ends first, :meth:`flush`
    drops them (where ``decode`` would show U+FFFD; see the module docstring).
    Invalid byte sequences that cannot become valid are emitted as U+FFFD at
    once, exactly as ``decode`` renders them.

    Two strategies, picked from the tokenizer:

    * byte-level BPE (the default model's, GPT-2 style, "Ġ" = space): each token
      maps to its raw bytes, which feed an incremental UTF-8 decoder. O(1) per
      token, exact.
    * anything else (e.g. SentencePiece): vLLM's window method. The window
      starts with the last few prompt tokens as context (SentencePiece drops
      the leading space of the first token of a ``decode`` call); each step
      decodes the window twice, with and without the unread tokens, and emits
      the difference unless it ends in U+FFFD. The window slides forward as
      text is emitted, so the cost per token stays bounded. Here the deltas
      equal ``decode(context + output)`` minus ``decode(context)``.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the request's prompt; only the window strategy reads
            it (the last 5 ids), and only when they decode to whole characters.
        skip_special_tokens: leave special tokens out of the text, as
            ``tokenizer.decode`` does.
        strategy: ``"auto"`` (byte-level when the tokenizer allows it),
            ``"bytes"`` or ``"window"``.

    Raises:
        ValueError: unknown ``strategy``, or ``"bytes"`` for a tokenizer that is
            not byte-level.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, *, strategy: str = "auto"):
        if strategy not in ("auto", "bytes", "window"):
            raise ValueError(f"strategy: must be 'auto', 'bytes' or 'window', got {strategy!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._finished = False
        vocab = _byte_vocab(tokenizer) if strategy != "window" else None
        if strategy == "bytes" and vocab is None:
            raise ValueError("strategy: 'bytes' needs a byte-level BPE tokenizer")
        self._vocab = vocab
        if vocab is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
            context_text = self._decode(context)
            if context_text.endswith(_REPLACEMENT_CHAR):
                # Context ending inside a character would let the first output
                # token complete it and rewrite text that is not ours to emit.
                context, context_text = [], ""
            # _window[:_read] has been emitted; decode(_window[:_read]) == _read_text.
            self._window: list[int] = context
            self._read = len(context)
            self._read_text = context_text

    @property
    def finished(self) -> bool:
        """True once :meth:`flush` has been called."""
        return self._finished

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append newly generated token ids; returns the text they complete (may be "").

        Raises:
            RuntimeError: called after :meth:`flush`.
        """
        if self._finished:
            raise RuntimeError("add_tokens after flush")
        if self._vocab is not None:
            return self._add_bytes(new_token_ids, final=False)
        self._window.extend(new_token_ids)
        return self._advance_window(final=False)

    def flush(self) -> str:
        """End of generation: the text still held back, without the bytes of a
        trailing incomplete character (dropped, so the text never ends in a
        U+FFFD that stands for a cut character). Later calls return ""."""
        if self._finished:
            return ""
        self._finished = True
        if self._vocab is not None:
            return self._add_bytes((), final=True)
        return self._advance_window(final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _add_bytes(self, token_ids: Sequence[int], final: bool) -> str:
        vocab, utf8 = self._vocab, self._utf8
        pieces, added = vocab.pieces, vocab.added
        out: list[str] = []
        run = bytearray()
        for token_id in token_ids:
            if token_id in added:
                text, special = added[token_id]
                if special and self._skip_special_tokens:
                    continue  # dropped before decoding: bytes on both sides still join
                # tokenizers decodes the bytes before an added token on their own.
                out.append(utf8.decode(bytes(run), final=True))
                utf8.reset()
                run.clear()
                out.append(text)
            elif 0 <= token_id < len(pieces):
                run += pieces[token_id]
        out.append(utf8.decode(bytes(run)))
        if final:
            pending = utf8.getstate()[0]
            utf8.reset()
            if not _is_truncated_character(pending):
                out.append(pending.decode("utf-8", "replace"))  # invalid, not cut: as decode
        return "".join(out)

    def _advance_window(self, final: bool) -> str:
        text = self._decode(self._window)
        if final and text.endswith(_REPLACEMENT_CHAR):
            text = self._without_cut_character(text)
        if len(text) <= len(self._read_text):
            return ""  # e.g. only skipped special tokens so far
        if text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # possibly a character still being completed
        delta = text[len(self._read_text):]
        # Slide: keep only the last read segment as the next step's left context.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return delta

    def _without_cut_character(self, text: str) -> str:
        """``text`` (the window's decode) without the U+FFFD of an incomplete
        character at the end of the window's bytes, if there is one.

        The window strategy sees tokens, not bytes, so the bytes are read back
        from the token strings: SentencePiece byte-fallback pieces (``<0xE4>``)
        carry one byte, a byte-level BPE token its GPT-2 byte alphabet, any
        other token its text (whole characters). When the cut character's bytes
        are exactly the last tokens' (byte fallback, where ``decode`` shows one
        U+FFFD per byte), the text is decoded again without those tokens;
        when it starts inside a token (byte-level BPE, one U+FFFD), that
        U+FFFD is removed.
        """
        hf = self._tokenizer.hf_tokenizer
        added = getattr(hf, "added_tokens_decoder", {})
        backend = getattr(hf, "backend_tokenizer", None)
        byte_level = False
        if backend is not None:
            from tokenizers import decoders

            byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        to_byte = _gpt2_unicode_to_byte() if byte_level else {}
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        window = self._window
        run_len = 0
        starts: dict[int, int] = {}  # the last run's tokens: index -> offset of their first byte
        for i, (token_id, token) in enumerate(
                zip(window, self._tokenizer.convert_ids_to_tokens(window))):
            if token_id in added:
                if added[token_id].special and self._skip_special_tokens:
                    continue      # skipped before decoding: the bytes around it join
                utf8.reset()      # decoded on its own: it ends the run of bytes before it
                run_len, starts = 0, {}
                continue
            starts[i] = run_len
            if token is None:     # outside the vocabulary: decodes to nothing
                continue
            match = _BYTE_FALLBACK_PIECE.fullmatch(token)
            if match:
                piece = bytes([int(match.group(1), 16)])
            elif byte_level:
                piece = b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode("utf-8")
                                 for c in token)
            else:
                piece = token.encode("utf-8")
            utf8.decode(piece)
            run_len += len(piece)
        pending = utf8.getstate()[0]
        if not _is_truncated_character(pending):
            return text
        tail_start = run_len - len(pending)
        cut = next((i for i, offset in starts.items() if offset == tail_start), None)
        if cut is not None:   # the cut character is the last tokens' bytes and nothing else
            return self._decode(window[:cut])
        return text[:-1]      # it starts inside a token: decode shows one U+FFFD for it


class StopStringMatcher:
    """Cuts streamed text at the first completed stop string.

    Fed text deltas in order, :meth:`process` returns the text that is safe to
    emit: a tail of the text that could still be the beginning of a stop string
    is held back and released (exactly once) as soon as it cannot be, or by
    :meth:`flush` at the end of generation.

    The match is the stop string that is completed first, i.e. whose end comes
    earliest in the text; between stop strings ending at the same place, the
    longer one. This is the only rule that a stream can apply without waiting,
    and it does not depend on how the text is split into deltas, so streamed
    output equals non-streamed output. (With stop ``["abcd", "bc"]`` the text
    "abcd" matches "bc" at "abc".)

    Attributes:
        matched: the stop string that ended the text, once one has; else None.

    Args:
        stop: non-empty stop strings; none means text passes through unchanged.
        include_stop_str_in_output: end the text after the matched stop string
            instead of before it.

    Raises:
        ValueError: an empty stop string (it would match everywhere).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        # Proper prefixes of the stop strings, by length, to size the held-back tail.
        self._prefixes = {s[:k] for s in self._stop for k in range(1, len(s))}
        self._max_prefix_len = max((len(s) - 1 for s in self._stop), default=0)
        self._held = ""
        self.matched: str | None = None
        self._finished = False

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    @property
    def finished(self) -> bool:
        """True after a stop string matched or :meth:`flush` was called."""
        return self._finished

    def process(self, delta: str) -> tuple[str, str | None]:
        """Consume the next piece of text.

        Returns:
            ``(text_to_emit, matched)``: ``matched`` is the stop string when this
            delta completed one (the text then ends before it, or after it with
            ``include_stop_str_in_output``, and generation should stop), else None.

        Raises:
            RuntimeError: called after a match or after :meth:`flush`.
        """
        if self._finished:
            raise RuntimeError("process after the text has ended")
        if not self._stop:
            return delta, None
        text = self._held + delta
        # No stop string ends inside the held tail (it would have matched
        # already), so a new match must end inside ``delta``.
        best: tuple[int, int, str] | None = None  # (end, -length, stop string)
        for s in self._stop:
            start = text.find(s, max(0, len(self._held) - len(s) + 1))
            if start >= 0:
                candidate = (start + len(s), -len(s), s)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, neg_len, s = best
            self._held, self.matched, self._finished = "", s, True
            return text[:end if self._include else end + neg_len], s
        keep = self._held_tail_len(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """End of generation: the held-back text (a partial stop string that never
        completed), which is then part of the output. Later calls return ""."""
        held, self._held, self._finished = self._held, "", True
        return held

    def _held_tail_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for k in range(min(self._max_prefix_len, len(text)), 0, -1):
            if text[-k:] in self._prefixes:
                return k
        return 0


def detokenize_until_stop(detokenizer: IncrementalDetokenizer, matcher: StopStringMatcher,
                          token_ids: Sequence[int], finished: bool) -> tuple[str, str | None, int]:
    """Feed a step's new tokens to ``detokenizer`` and ``matcher``, one token at a
    time while stop strings are set, so that a stop string completed by one token
    of a multi-token step (speculative decoding) ends the sample on that token.

    Args:
        token_ids: the step's new token ids.
        finished: the sample ended with these tokens (the detokenizer is flushed
            after the last one, unless a stop string ended it earlier).

    Returns:
        ``(text, stop, num_used)``: the text safe to emit, the matched stop string
        (or None), and how many of ``token_ids`` the sample keeps (all, or up to
        and including the token that completed the stop string).
    """
    ids = list(token_ids)
    if not matcher.has_stop_strings:
        text = detokenizer.add_tokens(ids)
        if finished:
            text += detokenizer.flush()
        return matcher.process(text)[0], None, len(ids)
    pieces: list[str] = []
    for i, t in enumerate(ids):
        text = detokenizer.add_tokens([t])
        if finished and i == len(ids) - 1:
            text += detokenizer.flush()
        emit, stop = matcher.process(text)
        pieces.append(emit)
        if stop is not None:
            return "".join(pieces), stop, i + 1
    if not ids and finished:
        emit, stop = matcher.process(detokenizer.flush())
        return emit, stop, 0
    return "".join(pieces), None, len(ids)
