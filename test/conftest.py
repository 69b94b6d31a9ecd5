"""Shared pytest fixtures: the built binary and the exported golden models."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "test", "data", "fixtures")
sys.path.insert(0, ROOT)


def run(cmd, check=True, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def build_fp8_harness(out_dir):
    """test/fp8_harness.c (laguna.h's e4m3 / bf16 / fp16 rounding helpers), built warning-free; returns its path."""
    exe = os.path.join(str(out_dir), "fp8_harness")
    run([os.environ.get("CC", "cc"), "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", ROOT,
         os.path.join(ROOT, "test", "fp8_harness.c"), "-o", exe, "-lm"])
    return exe


@pytest.fixture(scope="session")
def laguna():
    run(["make", "-C", ROOT, "laguna"])
    return os.path.join(ROOT, "laguna")


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """name -> path of the fixture exported with export.py (cached for the session)."""
    out = tmp_path_factory.mktemp("models")
    cache = {}

    def get(name, *extra):
        key = (name,) + extra
        if key not in cache:
            path = str(out / ("_".join(key).replace("-", "") + ".bin"))
            run([sys.executable, os.path.join(ROOT, "export.py"), "-q",
                 os.path.join(FIXTURES, name, "hf"), path, *extra])
            cache[key] = path
        return cache[key]
    return get
