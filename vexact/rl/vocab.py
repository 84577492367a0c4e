"""The task vocabularies: the character vocabulary every task shares (``CharTokenizer``, 22 ids) and the same
vocabulary followed by a tail of distractor tokens (``TailTokenizer``, ``task.distractors``; ``vexact.rl.vocab_tail``
measures the tail's mass).

A leaf of ``vexact.rl``: it imports no vexact module, so the tasks (which tokenize with it) and the vocabulary tail
(which extends it) both import it, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BOS_ID", "CHARS", "CHAR_VOCAB_SIZE", "EOS_ID", "MAX_DISTRACTORS", "NO_CHARACTER", "PAD_ID",
           "SPECIAL_TOKENS", "CharTokenizer", "TailTokenizer", "check_distractors", "tokenizer_for"]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789abc+=:<>#"
"""Ordinary characters, ids ``3 ..``: digits, the count letters, separators and task tags."""
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARS)
"""22: ids from here up are a vocabulary tail's distractors (``task.distractors``, ``TailTokenizer``)."""

MAX_DISTRACTORS = 262_144
"""Upper bound of ``task.distractors`` (``vexact.rl.vocab_tail``: a vocabulary beyond real ones, 150k, with room to
spare); a larger value is more likely a typo than a plan, and would allocate an embedding of that many rows."""

NO_CHARACTER = "\ufffd"
"""What a distractor decodes to: the Unicode replacement character, in no task's prompt, answer or format."""


class CharTokenizer:
    """One id per character; ids 0-2 are PAD, BOS and EOS. The same vocabulary serves every task."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        self.tokens: tuple[str, ...] = SPECIAL_TOKENS + tuple(CHARS)
        self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARS)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no BOS/EOS added). Unknown characters raise ``ValueError``."""
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {CHARS!r}") from None

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> str:
        """Text of ``ids``: PAD and BOS are skipped; decoding stops at the first EOS (or skips EOS if
        ``stop_at_eos`` is False). Ids outside the vocabulary raise ``ValueError``."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID and stop_at_eos:
                break
            if i in (PAD_ID, BOS_ID, EOS_ID):
                continue
            out.append(self._char(i))
        return "".join(out)

    def _char(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return self.tokens[i]

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def check_distractors(n: object) -> int:
    """``n`` if it is a valid distractor count (an int in ``[0, MAX_DISTRACTORS]``), else ``ValueError``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_DISTRACTORS:
        raise ValueError(f"distractors must be an integer in [0, {MAX_DISTRACTORS}], got {n!r}")
    return n


class TailTokenizer(CharTokenizer):
    """The character vocabulary followed by ``distractors`` tokens ``<d0> .. <dN-1>`` that decode to
    ``NO_CHARACTER``. Encoding is the character vocabulary's: no text encodes to a distractor."""

    def __init__(self, distractors: int) -> None:
        super().__init__()
        self.distractors = check_distractors(distractors)
        self.tokens = self.tokens + tuple(f"<d{k}>" for k in range(distractors))

    @property
    def first_distractor(self) -> int:
        """Id of the first distractor (the character vocabulary's size)."""
        return CHAR_VOCAB_SIZE

    def is_distractor(self, i: int) -> bool:
        return CHAR_VOCAB_SIZE <= int(i) < self.vocab_size

    def _char(self, i: int) -> str:
        return NO_CHARACTER if self.is_distractor(i) else super()._char(i)

    def __repr__(self) -> str:
        return f"TailTokenizer(vocab_size={self.vocab_size}, distractors={self.distractors})"


def tokenizer_for(distractors: int) -> CharTokenizer:
    """The character vocabulary (``distractors`` 0: the very same tokenizer as before the knob) or a tail."""
    return CharTokenizer() if check_distractors(distractors) == 0 else TailTokenizer(distractors)
