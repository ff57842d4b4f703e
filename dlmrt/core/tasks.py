"""The tiny task suite: synthetic tasks whose answers can be checked exactly.

Each task's output tokens depend on the input and on each other differently:

- `rev`  reverse a word: each output letter is a copy of one input letter;
- `sort` sort digits: each output digit depends on the whole input multiset,
  and the outputs are ordered among themselves;
- `add`  add two 3-digit numbers: each digit depends on the digits to its
  right through the carry chain, so decoding one token at a time helps.
  Operands and sum are zero-padded to fixed widths, so that each answer digit
  sits at a fixed distance from the operand digits it depends on;
- `same` one of the 3 to 8 input letters, written once per input letter: every
  input letter gives a right answer, so no output token is determined until
  one is chosen, and then all are. One token per step copies the first choice;
  committing several at once picks them independently and they disagree.
  This task gives the suite's speed-quality curve its shape. Its score is a
  verifier (`is_correct`); the other tasks have one right answer each, and
  theirs is exact match.

Prompts read `task:input=` and the answer follows, then end-of-sequence, e.g.
`add:317+045=` -> `0362`. A prompt belongs to the held-out split when the CRC-32
of its text is divisible by 5 (about 20%), so the split is fixed without
storing any list. The character-level tokenizer covers exactly this alphabet.
"""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers import Regex

SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|mask|>")
PAD_ID, EOS_ID, MASK_ID = 0, 1, 2
ALPHABET = string.digits + string.ascii_lowercase + "+=: "
MIN_LEN, MAX_LEN = 3, 8


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(MIN_LEN, MAX_LEN)))
    return word, word[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choices(string.digits, k=rng.randint(MIN_LEN, MAX_LEN)))
    return digits, "".join(sorted(digits))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f"{a:03d}+{b:03d}", f"{a + b:04d}"


def _same(rng: random.Random) -> tuple[str, str]:
    """The prompt's letters and one right answer (the training target: a random letter's)."""
    letters = "".join(rng.sample(string.ascii_lowercase, rng.randint(MIN_LEN, MAX_LEN)))
    return letters, rng.choice(letters) * len(letters)


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "rev": _reverse, "sort": _sort, "add": _add, "same": _same}


def _is_one_letter_repeated(example: Example, output: str) -> bool:
    letters = example.prompt.removeprefix("same:").removesuffix("=")
    return len(output) == len(letters) and output[:1] in letters and output == output[:1] * len(letters)


# Tasks with more than one right answer, and what checks an output (the rest: equal to the answer).
VERIFIERS: dict[str, Callable[[Example, str], bool]] = {"same": _is_one_letter_repeated}


def is_correct(example: Example, output: str | None) -> bool:
    """Whether `output` answers `example`: its task's verifier, or else equality with the answer."""
    if output is None:
        return False
    verifier = VERIFIERS.get(example.task)
    return verifier(example, output) if verifier is not None else output == example.answer


def split_of(prompt: str) -> str:
    return "test" if zlib.crc32(prompt.encode()) % 5 == 0 else "train"


def sample(task: str, split: str, rng: random.Random) -> Example:
    """One example of `task` from `split` ("train" or "test")."""
    while True:
        question, answer = TASKS[task](rng)
        prompt = f"{task}:{question}="
        if split_of(prompt) == split:
            return Example(task, prompt, answer)


def examples(split: str, per_task: int, seed: int, tasks: tuple[str, ...] = tuple(TASKS)) -> list[Example]:
    """A fixed list of `per_task` distinct examples of each task (distinct prompts)."""
    rng = random.Random(seed)
    chosen: list[Example] = []
    for task in tasks:
        seen: set[str] = set()
        while len(seen) < per_task:
            example = sample(task, split, rng)
            if example.prompt not in seen:
                seen.add(example.prompt)
                chosen.append(example)
    return chosen


def build_tokenizer() -> Tokenizer:
    """A character-level tokenizer: the special tokens, then one token per character of ALPHABET."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
