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

Those four are the suite the shipped tiny models know (`TASKS`, the default everywhere). Two more
(`HEADROOM_TASKS`) have long answers, 31 digits and end-of-sequence in a canvas of 32, so that
decoding them in one block leaves tokens per forward room up to 32; each of their answer digits
follows from its neighbour in the answer, so committing many at once must hurt:

- `psum` running sums: the i-th answer digit is the sum of the first i+1 input digits, mod 10.
  Given the answer digit before it, it is one addition; without it, a sum of up to 31 digits.
- `mul`  a 30-digit number times one digit, zero-padded to 31 digits: each digit is the product's
  digit plus the carry from everything to its right. The answer digit to its right fixes that carry
  (given the inputs); without it the carry is a chain through every lower digit. Most carries
  settle within the next input digit or two, so parallel decoding costs `mul` less than `psum`
  (measured: docs/tiny-model.md).

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

from dlmrt.core.errors import ArgumentError

SPECIAL_TOKENS = ("<|pad|>", "<|eos|>", "<|mask|>")
PAD_ID, EOS_ID, MASK_ID = 0, 1, 2
ALPHABET = string.digits + string.ascii_lowercase + "+=: "
MIN_LEN, MAX_LEN = 3, 8
HEADROOM_DIGITS = 31  # the answer length of the headroom tasks; with end-of-sequence, a canvas of 32


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


def _running_sum(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randrange(10) for _ in range(HEADROOM_DIGITS)]
    sums = [sum(digits[:i + 1]) % 10 for i in range(len(digits))]
    return "".join(map(str, digits)), "".join(map(str, sums))


def _multiply(rng: random.Random) -> tuple[str, str]:
    """A (HEADROOM_DIGITS - 1)-digit number (leading zeros allowed) times a digit, zero-padded."""
    a, b = rng.randrange(10 ** (HEADROOM_DIGITS - 1)), rng.randrange(10)
    return f"{a:0{HEADROOM_DIGITS - 1}d}x{b}", f"{a * b:0{HEADROOM_DIGITS}d}"


Generator = Callable[[random.Random], tuple[str, str]]
TASKS: dict[str, Generator] = {"rev": _reverse, "sort": _sort, "add": _add, "same": _same}
HEADROOM_TASKS: dict[str, Generator] = {"psum": _running_sum, "mul": _multiply}
ALL_TASKS: dict[str, Generator] = {**TASKS, **HEADROOM_TASKS}
# The most tokens a task's answer and its prompt take (the tokenizer has one token per character).
LONGEST_ANSWER = {"rev": MAX_LEN, "sort": MAX_LEN, "add": 4, "same": MAX_LEN, "psum": HEADROOM_DIGITS,
                  "mul": HEADROOM_DIGITS}
LONGEST_PROMPT = {"rev": 5 + MAX_LEN, "sort": 6 + MAX_LEN, "add": 12, "same": 6 + MAX_LEN,
                  "psum": 6 + HEADROOM_DIGITS, "mul": 4 + HEADROOM_DIGITS + 2}


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


def check_task_names(names: tuple[str, ...]) -> None:
    """An ArgumentError unless `names` is a non-empty list of known tasks."""
    unknown = [name for name in names if name not in ALL_TASKS]
    if unknown or not names:
        raise ArgumentError(f"unknown task {', '.join(map(repr, unknown)) or '(none given)'}: tasks are "
                            f"{', '.join(ALL_TASKS)}")


def check_canvas(names: tuple[str, ...], gen_length: int, context: int | None = None) -> None:
    """An ArgumentError unless every answer of these tasks, then end-of-sequence, fits `gen_length`
    generated tokens, and (given the model's `context`) its longest prompt plus `gen_length` fits that."""
    check_task_names(names)
    answer = max(names, key=LONGEST_ANSWER.__getitem__)
    if LONGEST_ANSWER[answer] + 1 > gen_length:
        raise ArgumentError(f"task {answer!r} answers in up to {LONGEST_ANSWER[answer]} tokens, and with "
                            f"end-of-sequence needs a generation length of {LONGEST_ANSWER[answer] + 1}, "
                            f"got {gen_length}: raise the generation length or drop the task")
    prompt = max(names, key=LONGEST_PROMPT.__getitem__)
    if context is not None and LONGEST_PROMPT[prompt] + gen_length > context:
        raise ArgumentError(f"task {prompt!r} has prompts of up to {LONGEST_PROMPT[prompt]} tokens: with "
                            f"{gen_length} generated that is {LONGEST_PROMPT[prompt] + gen_length}, more than the "
                            f"model's context of {context}: use a model with a longer context (max_sequence_length) "
                            f"or drop the task")


def split_of(prompt: str) -> str:
    return "test" if zlib.crc32(prompt.encode()) % 5 == 0 else "train"


def sample(task: str, split: str, rng: random.Random) -> Example:
    """One example of `task` from `split` ("train" or "test")."""
    while True:
        question, answer = ALL_TASKS[task](rng)
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
