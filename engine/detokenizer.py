"""IncrementalDetokenizer: one request's generated tokens turned into text as they come, and stop strings.

The output processor makes one per request (per completion when n > 1) and calls `update()` once a
step with that step's new token ids; `update()` returns the stop string that fired, if any, and the
caller then finishes the request with finish_reason "stop". `output_text` is the text so far, cut at
the stop string as the params say. This module touches no scheduler or request state.

Two text decoders sit behind it, chosen once per request:
- `_StreamDecoder` (fast tokenizers): a `tokenizers.decoders.DecodeStream`, primed with the prompt's last
  few tokens. Rust holds back a token whose bytes end mid-character (no U+FFFD mid-text) and emits it
  once the character completes.
- `_OffsetDecoder` (any tokenizer with `convert_ids_to_tokens`/`convert_tokens_to_string`): decodes the
  token strings from a prefix offset twice (up to the read offset, and to the end) and emits the
  difference, holding back while the text ends in U+FFFD.

Both keep a few prompt tokens as context so the first generated token is decoded as it reads after the
prompt. NOTE: for byte-level BPE (GPT-2, SmolLM2, Qwen) this changes nothing and the final text equals
`tokenizer.decode(output_ids, skip_special_tokens=...)`. For SentencePiece-style (Metaspace) tokenizers,
`decode(output_ids)` strips the first token's leading space while the incremental text keeps it
(" Paris"), as vLLM does; the final text then equals decode(prompt + output) minus decode(prompt).
Other differences from `tokenizer.decode`, all shared with vLLM:
- `clean_up_tokenization_spaces` is never applied (vLLM streams raw text; SmolLM2 has it off anyway).
- A trailing incomplete UTF-8 character (generation cut mid-character) is withheld, where decode would
  render U+FFFD; invalid bytes in the middle of the text still come out as U+FFFD.
- A prompt whose last token ends mid-character is not used as context (the stream would otherwise
  re-emit prompt text); the output then starts as decode(output_ids) does, with U+FFFD for the
  orphaned bytes.
- With `skip_special_tokens=False`: `spaces_between_special_tokens=False` drops the decoder's separator
  between two consecutive special tokens (fast path; byte-level BPE has none anyway). On the offset path
  True (the default) decodes the runs between added tokens separately and joins the pieces with spaces,
  as HF slow tokenizers and vLLM's slow path do ("done <|im_end|>"); False decodes all tokens together.

Stop strings (vLLM's rules): after each update only the new text plus the `len(stop) - 1` characters
before it is searched; the stop string that ends earliest wins (ties: list order); the text is cut at
its start, or at its end with `include_stop_str_in_output`. Text produced while the number of output
tokens is <= `min_tokens` is not searched, and no stop string fires until there are more than
`min_tokens` output tokens. When `stop_terminated` (the last new token is EOS / a stop token id) and
not `include_stop_str_in_output`, that token's text is not added; with it, the token is decoded like
any other (a special EOS still decodes to "" when skip_special_tokens).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .sampling_params import SamplingParams

# Prompt tokens decoded as context before the first generated one: enough for a decoder's
# first-token rules (Metaspace strip) and for byte-level merges to settle.
_NUM_CONTEXT_TOKENS = 6
# The offset path starts its prefix this many tokens before the read offset (vLLM uses 5).
_PREFIX_LOOKBACK = 5
_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX_MSG = "Invalid prefix encountered"


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str]) -> tuple[str, int, int] | None:
    """The stop string completing earliest within the last `num_new_chars` of `text`.

    Returns (stop, start, end) with text[start:end] == stop, or None. Only the new characters and the
    `len(stop) - 1` before them are searched: a match wholly inside older text was checked before.
    """
    if num_new_chars <= 0:
        return None
    best: tuple[str, int, int] | None = None
    for stop in stops:
        begin = max(0, len(text) - num_new_chars - (len(stop) - 1))
        start = text.find(stop, begin)
        if start == -1:
            continue
        end = start + len(stop)
        if best is None or end < best[2]:
            best = (stop, start, end)
    return best


def _backend_of(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast tokenizer (or the object itself), else None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a hard dependency
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for name in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, name, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class _StreamDecoder:
    """Fast path: a DecodeStream over the Rust tokenizer; one `step` per token, no re-decoding."""

    def __init__(self, backend: Any, context_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        context = list(context_ids)
        if context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(
                _REPLACEMENT_CHAR):
            # The prompt ends mid-character: DecodeStream would emit the prompt's text again once
            # the character completes, so decode the output on its own instead.
            context = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Priming by stepping (not the `ids=` argument) works on every tokenizers version we allow.
        for token_id in context:
            self._step(token_id)
        self._special_contents: dict[int, str] = {}
        self._last_was_special = False
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._special_contents = {
                tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:  # noqa: BLE001  tokenizers raises a bare Exception for this
            if not str(e).startswith(_INVALID_PREFIX_MSG):
                raise
            # Non-monotonic decoder output broke the stream's prefix; restart it without context
            # (vLLM issue 17448) rather than fail the request.
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def decode_next(self, token_id: int) -> str:
        text = self._step(token_id)
        if self._special_contents:
            content = self._special_contents.get(token_id)
            if content is not None and self._last_was_special:
                text = content  # no separator between two special tokens
            self._last_was_special = content is not None
        return text or ""


class _OffsetDecoder:
    """Slow path: token strings decoded from a prefix offset; works with any HF-style tokenizer."""

    def __init__(self, tokenizer: Any, context_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        added_decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special_ids.update(tid for tid, tok in added_decoder.items() if getattr(tok, "special", False))
        added_vocab = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self._added_tokens = set(added_vocab)
        self._tokens: list[str] = self._to_tokens(context_ids)
        if self._tokens and self._to_text(self._tokens).endswith(_REPLACEMENT_CHAR):
            self._tokens = []  # the prompt ends mid-character: see _StreamDecoder
        self._prefix_offset = max(len(self._tokens) - _PREFIX_LOOKBACK, 0)
        self._read_offset = len(self._tokens)

    def _to_tokens(self, ids: Sequence[int]) -> list[str]:
        if self._skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return list(self._tokenizer.convert_ids_to_tokens(list(ids)))

    def _to_text(self, tokens: list[str]) -> str:
        if (not self._spaces_between_special_tokens or not self._added_tokens
                or not any(t in self._added_tokens for t in tokens)):
            return self._tokenizer.convert_tokens_to_string(tokens)
        # As HF slow tokenizers do: added tokens verbatim, the runs between them decoded, joined by spaces.
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token in self._added_tokens:
                if run:
                    parts.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(token)
            else:
                run.append(token)
        if run:
            parts.append(self._tokenizer.convert_tokens_to_string(run))
        return " ".join(parts)

    def decode_next(self, token_id: int) -> str:
        self._tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._to_text(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._to_text(self._tokens[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing visible yet): wait for more tokens
        new_text = full_text[len(prefix_text):]
        # Advance, and drop token strings no later step will read (keeps each step O(window)).
        del self._tokens[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._tokens)
        return new_text


class IncrementalDetokenizer:
    """One request's output text, grown token by token, with stop-string checks (vLLM semantics)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, *,
                 use_fast: bool | None = None) -> None:
        """`use_fast`: None picks the DecodeStream path when the tokenizer has a Rust backend;
        False forces the offset path (tests, tokenizers without one)."""
        context_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        backend = _backend_of(tokenizer) if use_fast is not False else None
        if use_fast and backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no `tokenizers` backend for the fast path")
        decoder_cls = _StreamDecoder if backend is not None else _OffsetDecoder
        self._decoder: _StreamDecoder | _OffsetDecoder = decoder_cls(
            backend if backend is not None else tokenizer, context_ids,
            params.skip_special_tokens, params.spaces_between_special_tokens)
        self.stop: list[str] = list(params.stop or [])
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # Streaming holds back the characters a stop string being formed could still take away.
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.num_output_tokens = 0
        # The text lives as pieces joined on demand, so an update costs O(new text), not O(text).
        self._pieces: list[str] = []
        self._num_chars = 0
        self._tail = ""  # the last (longest stop - 1) characters, for matches across updates
        self._last_output_text_offset = 0

    @property
    def output_text(self) -> str:
        if len(self._pieces) != 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> str | None:
        """Append new tokens' text; return the stop string that fired, else None.

        `stop_terminated`: the last new token is EOS / a stop token id that ends the request.
        """
        if not new_token_ids:
            return None
        token_ids = list(new_token_ids)
        num_skipped = 0
        if stop_terminated and not self.include_stop_str_in_output:
            token_ids.pop()  # the stop token counts as output but adds no text
            num_skipped = 1
        new_pieces: list[str] = []
        num_unchecked_chars = 0  # text made while within min_tokens: never searched
        for token_id in token_ids:
            piece = self._decoder.decode_next(token_id)
            self.num_output_tokens += 1
            if piece:
                new_pieces.append(piece)
            if self.min_tokens and self.num_output_tokens <= self.min_tokens:
                num_unchecked_chars += len(piece)
        self.num_output_tokens += num_skipped
        new_text = "".join(new_pieces)
        if not new_text:
            return None
        self._pieces.append(new_text)
        old_num_chars = self._num_chars
        self._num_chars += len(new_text)
        if not self.stop:
            return None
        window = self._tail + new_text
        self._tail = window[-(self._max_stop_len - 1):] if self._max_stop_len > 1 else ""
        if self.num_output_tokens <= self.min_tokens:
            return None
        match = find_stop_string(window, len(new_text) - num_unchecked_chars, self.stop)
        if match is None:
            return None
        stop, start, end = match
        window_offset = old_num_chars - (len(window) - len(new_text))  # where `window` starts in the text
        cut = window_offset + (end if self.include_stop_str_in_output else start)
        if cut < self._num_chars:
            self._pieces = [self.output_text[:cut]]
            self._num_chars = cut
            self._tail = self._pieces[0][-(self._max_stop_len - 1):] if self._max_stop_len > 1 else ""
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it, or (delta) what is new since the last call.

        While unfinished, the last `stop_buffer_length` characters are held back: a stop string that
        is still forming would be cut from the final text.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        visible = max(self._num_chars - buffer_length, 0)
        if not delta:
            return self.output_text[:visible]
        start = self._last_output_text_offset
        if visible <= start:
            return ""
        self._last_output_text_offset = visible
        return self.output_text[start:visible]
