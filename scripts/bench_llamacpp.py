"""dlmrt beside llama.cpp's diffusion CLI on a CPU, at the same work: one checkpoint, one prompt, one run.

    python scripts/bench_llamacpp.py                                   # llama.cpp found on PATH, or skipped
    LLAMA_CPP_BIN=~/llama.cpp/build/bin LLAMA_CPP_SOURCE=~/llama.cpp python scripts/bench_llamacpp.py --rounds 3

llama.cpp is found, never downloaded or built by this script:
- `llama-diffusion-cli`: in --llama-cpp-bin or $LLAMA_CPP_BIN (a build's bin/ folder), else on PATH;
- its converter `convert_hf_to_gguf.py`: in --llama-cpp-source or $LLAMA_CPP_SOURCE (the source tree),
  run by --converter-python or $LLAMA_CPP_PYTHON [default: this interpreter], which needs the
  converter's own requirements (transformers, numpy, torch, sentencepiece).
Where either is missing the script says which and how to point at it, and exits 0 without timing.

The work, the same on both sides:
- one random LLaDA checkpoint (`llada-512x6`'s config and seeded weights), written as a Hugging Face
  directory with a byte-level BPE tokenizer trained here on seeded words (2046 ids, then <|endoftext|>
  and <|mdm_mask|>, the ids the random model uses for EOS and mask). llama.cpp's converter turns it into
  F32, F16, BF16 and Q8_0 GGUF files; dlmrt loads the directory itself, in float32 and in bfloat16.
- one 32-token prompt (BOS, which llama.cpp's LLaDA adds, and 31 tokens of text); 128 tokens in blocks
  of 32, 128 steps (one token a step), greedy, end-of-sequence ignored, no cache;
- 2 threads each (--threads); every case once a round, in an order shuffled per round, after one
  untimed run; medians of the rounds with their ranges.

Two things about llama.cpp's CLI shape the call. It counts blocks over the whole canvas, prompt included
(160 tokens: 5 blocks of 32), so it is asked for 160 steps: 32 a block, and the fifth block, which holds
no masked position, stops after one forward. That makes 129 forwards to dlmrt's 128, and its "time per
step" divides by 160; this script takes its total time and counts the forwards from its progress lines.
And it computes the logits of all 160 positions a forward, where dlmrt computes the block's 32.

llama.cpp's converter identifies a BPE tokenizer by hashing how it splits a fixed text, and knows only
published tokenizers. This one is GPT-2's scheme (byte-level BPE, GPT-2's split pattern) over its own
vocabulary, so the script runs the converter with the identification answered as "gpt-2".

Tokens/s is the generated tokens over each tool's own time for the generation (llama.cpp's "total time",
dlmrt's latency), model loading excluded on both sides. "same text" compares each case's decoded
output with llama.cpp F32's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
PROMPT_TOKENS, GEN_LENGTH, BLOCK_LENGTH, STEPS = 32, 128, 32, 128
SAME_WORK = ", fixed, no cache"
HALF_SUFFIX = f", bfloat16{SAME_WORK}"
LLAMA_F32, DLMRT_F32 = "llama.cpp F32", f"dlmrt torch:eager{SAME_WORK}"
BASE_MODEL = "llada-512x6"
LLADA_RMS_NORM_EPS = 1e-5  # LLaDA's; the GGUF needs it written out, dlmrt's default is the same
EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mdm_mask|>"
# llama-diffusion-cli always formats the prompt with the model's chat template (a default one where the
# GGUF has none): this one passes the prompt through as it is.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# The converter's main, with its tokenizer identification answered: see the module docstring.
CONVERT = """
import sys
source = sys.argv.pop(1)
sys.path[:0] = [source, source + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""
LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ", re.MULTILINE)
STEP_LINE = re.compile(r"diffusion step: (\d+)/\d+")
TOTAL_TIME = re.compile(r"total time: ([0-9.]+)ms")


class Skip(Exception):
    """llama.cpp, or what converting to GGUF needs, is not here: the reason, and how to point at it."""


# -- finding llama.cpp --------------------------------------------------------------------------------------
def find_cli(bin_dir: str | None) -> Path:
    given = bin_dir or os.environ.get("LLAMA_CPP_BIN")
    if given:
        cli = Path(given).expanduser() / "llama-diffusion-cli"
        if not cli.is_file():
            raise Skip(f"{cli} does not exist: give the bin/ folder of a llama.cpp build (--llama-cpp-bin or "
                       f"$LLAMA_CPP_BIN)")
        return cli
    found = shutil.which("llama-diffusion-cli")
    if found is None:
        raise Skip("llama-diffusion-cli is not on PATH: build llama.cpp (its examples/diffusion) and put its "
                   "bin/ folder on PATH, or pass it as --llama-cpp-bin or $LLAMA_CPP_BIN")
    return Path(found)


def find_converter(source: str | None, cli: Path, python: str) -> Path:
    given = source or os.environ.get("LLAMA_CPP_SOURCE")
    candidates = [Path(given).expanduser()] if given else list(cli.resolve().parents)[:4]
    tree = next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)
    if tree is None:
        where = given or f"the folders above {cli}"
        raise Skip(f"no convert_hf_to_gguf.py in {where}: give llama.cpp's source tree as --llama-cpp-source "
                   f"or $LLAMA_CPP_SOURCE")
    needs = "import transformers, numpy, torch, sentencepiece"
    if subprocess.run([python, "-c", needs], capture_output=True).returncode != 0:
        raise Skip(f"{python} cannot run llama.cpp's converter ({needs!r} fails): install "
                   f"{tree / 'requirements' / 'requirements-convert_hf_to_gguf.txt'} there, or name an "
                   f"interpreter that has it (--converter-python or $LLAMA_CPP_PYTHON)")
    return tree


# -- the checkpoint and the prompt --------------------------------------------------------------------------
def seeded_words(seed: int = 0, lines: int = 3000):
    """Lines of letter words with English-like letter frequencies: text for the BPE to learn merges from."""
    rng = random.Random(seed)
    letters, weights = "etaoinshrdlcumwfgypbvkjxqz", [13, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3] + [2] * 6 + [1] * 7
    for _ in range(lines):
        yield " ".join("".join(rng.choices(letters, weights, k=rng.randint(1, 9))) for _ in range(20))


def train_tokenizer(vocab_size: int):
    """Byte-level BPE (GPT-2's scheme) of `vocab_size - 2` ids, then EOS and mask as the last two."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(seeded_words(), trainers.BpeTrainer(
        vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if tokenizer.get_vocab_size() != vocab_size - 2:
        raise RuntimeError(f"the tokenizer learned {tokenizer.get_vocab_size()} ids, not {vocab_size - 2}")
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True), AddedToken(MASK_TOKEN, special=True)])
    return tokenizer


def write_checkpoint(directory: Path) -> Path:
    """The benchmark's random LLaDA as a Hugging Face directory both tools read."""
    from dlmrt.bench.models import random_model
    from dlmrt.models import checkpoint

    model = random_model(BASE_MODEL)
    model.raw_config["rms_norm_eps"] = LLADA_RMS_NORM_EPS
    model.tokenizer = train_tokenizer(model.vocab_size)
    model.tokenizer_config = json.dumps({"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
                                         "mask_token": MASK_TOKEN, "chat_template": PLAIN_CHAT_TEMPLATE,
                                         "tokenizer_class": "PreTrainedTokenizerFast"}).encode()
    return checkpoint.save(model, directory)


def prompt_text(tokenizer, tokens: int) -> str:
    """Text of exactly `tokens` tokens: seeded words, one at a time, until the count is reached."""
    words = " ".join(seeded_words(seed=1, lines=20)).split()
    text = ""
    for word in words:
        longer = f"{text} {word}" if text else word
        count = len(tokenizer.encode(longer).ids)
        if count == tokens:
            return longer
        if count < tokens:
            text = longer
    raise RuntimeError(f"no prefix of the seeded words is {tokens} tokens long")


def convert(python: str, tree: Path, checkpoint_dir: Path, outtype: str, out: Path) -> Path:
    done = subprocess.run([python, "-c", CONVERT, str(tree), str(checkpoint_dir), "--outtype", outtype,
                           "--outfile", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {outtype}:\n{done.stderr[-3000:]}")
    return out


# -- running llama.cpp --------------------------------------------------------------------------------------
def parse_cli_log(log: str) -> tuple[float, int, str]:
    """(seconds, forwards, output text) from llama-diffusion-cli's log: its total time, the steps its
    progress lines show (one forward each), and the text it prints last."""
    total = TOTAL_TIME.search(log)
    if total is None:
        raise RuntimeError(f"llama-diffusion-cli printed no total time:\n{log[-2000:]}")
    forwards = len({int(n) for n in STEP_LINE.findall(log[:total.start()])})
    after = LOG_PREFIX.sub("", log[total.end():])
    text = after.split("\n", 1)[1] if "\n" in after else ""
    return float(total.group(1)) / 1e3, forwards, text.strip("\n")


def cli_command(cli: Path, gguf: Path, prompt: str, threads: int) -> list[str]:
    canvas = PROMPT_TOKENS + GEN_LENGTH
    return [str(cli), "-m", str(gguf), "-p", prompt, "-ub", str(canvas), "-b", str(canvas), "-c", str(canvas),
            "--diffusion-block-length", str(BLOCK_LENGTH), "--diffusion-steps", str(canvas), "--temp", "0",
            "--seed", "0", "-t", str(threads), "-tb", str(threads)]


def llama_case(label: str, command: list[str], texts: dict):
    from dlmrt.bench.case import Case
    from dlmrt.runtime.metrics import GenerationMetrics

    def run():
        done = subprocess.run(command, capture_output=True, text=True, errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"{label} failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
        try:
            seconds, forwards, texts[label] = parse_cli_log(done.stderr + done.stdout)
        except RuntimeError as error:
            raise RuntimeError(f"{label} ({' '.join(command)}): {error}") from None
        return GenerationMetrics(nfe=forwards, sequence_forwards=forwards, generated_tokens=GEN_LENGTH,
                                 prompt_tokens=PROMPT_TOKENS, batch_size=1, latency_s=seconds,
                                 forwards_executed=forwards)
    return Case(label, run, pool="llama.cpp")


# -- dlmrt's cases ------------------------------------------------------------------------------------------
def dlmrt_cases(model, half, prompt_ids: list[int], scratch: Path, texts: dict, threads: int, runs: int,
                console):
    """dlmrt's rows: each CPU backend at the same work (fixed, 128 steps, no cache), torch:auto being
    what `dlmrt generate` runs by default for `runs` such generations; the same checkpoint loaded in
    bfloat16 (`half`: what `dlmrt generate` runs for a checkpoint saved in bfloat16, as LLaDA's are), the
    counterpart of llama.cpp's F16 and BF16; and compile at its usual settings (threshold 0.9, dual
    cache)."""
    from dlmrt.bench.case import Case
    from dlmrt.bench.scenario_run import make_cases
    from dlmrt.runtime import Fixed, GenerationSettings, Threshold, text

    same_work = GenerationSettings(GEN_LENGTH, BLOCK_LENGTH, Fixed(steps=STEPS), cache="none", ignore_eos=True)
    usual = GenerationSettings(GEN_LENGTH, BLOCK_LENGTH, Threshold(0.9), cache="dual", ignore_eos=True)
    groups = [(model, same_work, [("torch", "eager"), ("torch", "auto"), ("torch", "compile"), ("ort", None),
                                  ("ort", "int8"), ("ort", "int8-dynamic"), ("ort", "int4")], SAME_WORK),
              (half, same_work, [("torch", "auto")], HALF_SUFFIX),
              (model, usual, [("torch", "compile")], ", threshold 0.9 + dual cache")]
    cases = []
    for number, (loaded, settings, backends, suffix) in enumerate(groups):
        outputs: dict = {}
        made, _ = make_cases(loaded, backends, [prompt_ids], settings, scratch / str(number), console, threads,
                             outputs, runs)
        for case in made:
            label = f"dlmrt {case.label}{suffix}"

            def run(case=case, label=label, outputs=outputs):
                metrics = case.run()
                texts[label] = text.decode(model, outputs[case.label][0].tolist())
                return metrics
            cases.append(Case(label, run, "torch" if case.label.startswith("torch") else "onnxruntime"))
    return cases


# -- the table ----------------------------------------------------------------------------------------------
def rows_of(rounds, texts: dict, baseline: str, float_runs: dict[str, str]) -> list[dict]:
    """One row a case; `float_runs` names, per case, the float32 run of its own tool at the same work whose
    text it is compared with (cases not named are compared with none)."""
    rows = []
    for label, found in rounds.results.items():
        speeds = [m.tokens_per_s for m in found]
        per_forward = [m.latency_s / m.forwards_executed for m in found]
        against = float_runs.get(label)
        rows.append({"case": label, "tokens_per_s": statistics.median(speeds),
                     "tokens_per_s_range": [min(speeds), max(speeds)], "tokens_per_s_runs": speeds,
                     "ms_per_forward": statistics.median(per_forward) * 1e3, "forwards": found[0].forwards_executed,
                     "same_text": None if against in (None, label) else texts[label] == texts[against]})
    base = next(row for row in rows if row["case"] == baseline)["tokens_per_s"]
    for row in rows:
        row["vs_baseline"] = row["tokens_per_s"] / base
    return rows


def table(rows: list[dict], baseline: str, threads: int) -> Table:
    out = Table(title=f"{BASE_MODEL}: prompt {PROMPT_TOKENS}, {GEN_LENGTH} tokens in blocks of {BLOCK_LENGTH}, "
                      f"{threads} threads",
                caption="medians of the rounds (range); same text: as the tool's own float32 run at the same work")
    for header in ("run", "tokens/s", "ms per forward", "forwards", f"vs {baseline}", "same text"):
        out.add_column(header, justify="left" if header == "run" else "right")
    same = {None: "-", True: "yes", False: "no"}
    for row in rows:
        low, high = row["tokens_per_s_range"]
        out.add_row(row["case"], f"{row['tokens_per_s']:.1f} ({low:.1f}-{high:.1f})", f"{row['ms_per_forward']:.1f}",
                    str(row["forwards"]), f"{row['vs_baseline']:.2f}x", same[row["same_text"]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-bin", help="the bin/ folder of a llama.cpp build [default: $LLAMA_CPP_BIN, "
                                                "else PATH]")
    parser.add_argument("--llama-cpp-source", help="llama.cpp's source tree, for its converter [default: "
                                                   "$LLAMA_CPP_SOURCE, else the folders above the CLI]")
    parser.add_argument("--converter-python", default=os.environ.get("LLAMA_CPP_PYTHON", sys.executable),
                        help="the interpreter that runs the converter [default: $LLAMA_CPP_PYTHON, else this one]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoint and GGUF files here [default: a "
                                                      "temporary folder]")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        cli = find_cli(args.llama_cpp_bin)
        tree = find_converter(args.llama_cpp_source, cli, args.converter_python)
    except Skip as reason:
        console.print(f"skipped: {reason}")
        return 0

    import torch

    import dlmrt
    from dlmrt.bench.paired import interleaved_rounds
    from dlmrt.core import atomic

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work_dir or Path(scratch)
        with console.status("writing the checkpoint and converting it to GGUF"):
            checkpoint_dir = write_checkpoint(work / "checkpoint")
            ggufs = {kind: convert(args.converter_python, tree, checkpoint_dir, kind, work / f"model-{kind}.gguf")
                     for kind in GGUF_TYPES}
        model = dlmrt.load(checkpoint_dir)
        prompt = prompt_text(model.tokenizer, PROMPT_TOKENS - 1)
        prompt_ids = [model.tokens.eos_ids[0], *model.tokenizer.encode(prompt).ids]  # llama.cpp's BOS first
        texts: dict[str, str] = {}
        cases = [llama_case(f"llama.cpp {kind.upper()}", cli_command(cli, gguf, prompt, args.threads), texts)
                 for kind, gguf in ggufs.items()]
        half = dlmrt.load(checkpoint_dir, dtype="bfloat16")
        cases += dlmrt_cases(model, half, prompt_ids, Path(scratch) / "dlmrt", texts, args.threads, args.rounds + 1,
                             console)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("benchmarking", total=len(cases) * (args.rounds + 1))
            rounds = interleaved_rounds(cases, args.rounds, advance=lambda: progress.advance(task))
    float_runs = {case.label: (LLAMA_F32 if case.pool == "llama.cpp" else DLMRT_F32) for case in cases
                  if case.pool == "llama.cpp" or case.label.endswith(SAME_WORK)}
    rows = rows_of(rounds, texts, LLAMA_F32, float_runs)
    console.print(table(rows, LLAMA_F32, args.threads))
    agree = "the same" if texts[LLAMA_F32] == texts[DLMRT_F32] else "different"
    console.print(f"{LLAMA_F32} and {DLMRT_F32} decode {agree} text")
    if args.json:
        atomic.write_text(args.json, json.dumps({"threads": args.threads, "rounds": args.rounds, "rows": rows,
                                                 "same_text_as_llama_cpp": agree == "the same"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
