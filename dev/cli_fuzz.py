#!/usr/bin/env python3
"""Random command lines against the sanitizer build of laguna (`make laguna-asan`: AddressSanitizer and
UndefinedBehaviorSanitizer, leak checks on). Each run draws a model argument (the shipped tiny model most of the time,
else the drafter, a prompt file, an empty, truncated or missing file, a directory, /dev/null), up to five options with
values from edge cases (0, -1, huge, non-numeric, empty, nan / inf, hex, padded), a prompt (empty, long, non-ASCII,
special-token text, control bytes) and a few stdin lines for chat mode. A finding is a sanitizer report, a signal, a
run over 60 s, or a non-zero exit with nothing on stderr; everything else is a clean run or a refusal with a message.

    make laguna-asan && python3 dev/cli_fuzz.py [N] [seed] [binary]     (default 200 runs, seed 1, ./laguna-asan)

Prints each finding and a count per kind; exit status 1 if there was a finding. Runs of ~1,500-token prompts on the
CPU under the sanitizers may take longer than 60 s on a small machine (a timeout there is slowness, not a hang:
rerun the printed command with ./laguna to tell).
"""
import os
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    exe = os.path.abspath(sys.argv[3] if len(sys.argv) > 3 else os.path.join(ROOT, "laguna-asan"))
    if not os.path.exists(exe):
        sys.exit(f"{exe} not found: build it with `make laguna-asan` (or pass a binary)")
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="cli_fuzz_")
    tiny, draft = os.path.join(MODELS, "tiny.bin"), os.path.join(MODELS, "tiny-dflash.bin")

    def put(name, data):
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    with open(tiny, "rb") as f:
        head = f.read(100000)
    files = [tiny, draft, put("prompt.txt", b"def add(a, b):\n"), put("ids.txt", b"2 100 200 300 400\n"),
             put("badids.txt", b"2 99999999 -3 x\n"), put("empty.txt", b""), put("trunc.bin", head), "/nonexistent",
             tmp, "/dev/null", os.path.join(tmp, "out.bin")]
    nums = ["0", "1", "2", "-1", "-5", "3", "7", "15", "16", "17", "64", "255", "256", "257", "100000",
            "99999999999", "2147483648", "-2147483649", "1e3", "0.5", "abc", "", "nan", "inf", "-0", "0x10", " 4", "4 "]
    floats = ["0", "0.6", "1", "1.5", "-1", "nan", "inf", "-inf", "1e-30", "1e30", "x", "", "0.0000001", "2"]
    prompts = ["def f(", "", "x" * 3000, "h\u00e9llo w\u00f6rld \U0001f642", "<|im_start|>", "\x01\x02", "12 34",
               "2 5 7", "  ", "\n\n"]
    flags = {"-n": nums, "-t": floats, "-p": floats, "-s": nums, "-c": nums, "-i": files, "-y": prompts,
             "-m": ["generate", "chat", "x", ""], "--think": None, "--raw": None, "--ids": None, "--cpu": None,
             "--chunk": nums, "--kv": ["bf16", "f32", "fp8", "q4", ""], "--tokenize": prompts, "--score": files,
             "--logits": [os.path.join(tmp, "out.bin"), "/nonexistent/x", tmp], "-d": files, "--draft-max": nums,
             "--compare": None, "-q": None,
             "--samples": ["0", "1", "3", "-1", "abc", "", "1e3", "2147483648", "99999999999"],   # N whole runs
             "--taps": [os.path.join(tmp, "t.bin"), tmp],
             "--draft-logits": [os.path.join(tmp, "dl.bin")], "--random-weights": nums, "-h": None, "--bogus": None,
             "-": None}
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="print_stacktrace=1")
    counts = {}
    for _ in range(n):
        args = [exe]
        if rng.random() < 0.9:
            args.append(rng.choice([tiny] * 6 + files))
        for _ in range(rng.randint(0, 5)):
            f = rng.choice(list(flags))
            args.append(f)
            if flags[f] is not None and rng.random() < 0.95:
                args.append(rng.choice(flags[f]))
        if rng.random() < 0.8:
            args.append(rng.choice(prompts))
        if "-n" not in args and "--tokenize" not in args:   # short runs unless the draw sets -n itself
            args[2:2] = ["-n", "8"]
        stdin = "\n".join(rng.choice(prompts) for _ in range(rng.randint(0, 3))).encode()
        err = ""
        try:
            # in tmp: a draw such as `--logits -h` writes a file named "-h" where it runs
            p = subprocess.run(args, input=stdin, capture_output=True, timeout=60, env=env, cwd=tmp)
            err = p.stderr.decode(errors="replace")
            if "Sanitizer" in err or "runtime error:" in err:
                kind = "SANITIZER"
            elif p.returncode < 0 or p.returncode > 128:
                kind = "SIGNAL"
            elif p.returncode != 0 and not err.strip():
                kind = "SILENT"
            else:
                kind = "ran" if p.returncode == 0 else "refused"
        except subprocess.TimeoutExpired:
            kind = "TIMEOUT"
        counts[kind] = counts.get(kind, 0) + 1
        if kind not in ("ran", "refused"):
            print(kind, " ".join(repr(a) if not a or " " in a or "\n" in a else a for a in args[1:])[:400])
            if err:
                print("   ", err[-1500:].replace("\n", "\n    "))
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"seed {seed}: {n} command lines, " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    sys.exit(1 if set(counts) - {"ran", "refused"} else 0)


if __name__ == "__main__":
    main()
