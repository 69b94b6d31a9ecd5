#!/usr/bin/env python3
"""Build the training corpus from the Python sources installed with the running interpreter.

    python3 dev/tiny/corpus.py WORK [--smoke]

Sources: the standard library (sysconfig's stdlib path) and every distribution installed in the interpreter's
site-packages directories (only the .py files each distribution's RECORD lists, so every file has a known
package, version and licence). Files that are tiny, huge, undecodable, or mostly long lines (generated tables)
are skipped; exact duplicates are dropped. About 2% of the files, chosen by a hash of their path relative to the
source root ("stdlib/json/decoder.py", "site-packages/torch/nn/modules/linear.py"), form the held-out split.

Writes WORK/corpus/docs.jsonl (one {"key", "pkg", "split", "text"} per file) and WORK/corpus/manifest.json
(interpreter, roots, per-package version / licence / counts, every file used with its split and hash, and what
was skipped and why).
"""
import hashlib
import json
import os
import platform
import site
import sys
import sysconfig
import time
from importlib.metadata import distributions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import config  # noqa: E402

PERMISSIVE = ("mit", "bsd", "apache", "psf", "python software foundation", "isc", "unlicense", "zlib", "0bsd",
              "hpnd", "cc0", "public domain")


def licence_of(meta):
    """A short licence string from a distribution's METADATA."""
    expr = meta.get("License-Expression")
    if expr:
        return expr.strip()
    lic = (meta.get("License") or "").strip()
    classifiers = [c.split("::")[-1].strip() for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    if lic and lic.upper() != "UNKNOWN" and len(lic) <= 120 and "\n" not in lic:
        return lic
    if classifiers:
        return "; ".join(classifiers)
    if lic and lic.upper() != "UNKNOWN":
        return lic.splitlines()[0].strip()[:120] + " (first line of the License field)"
    return "unknown"


def is_permissive(lic):
    low = lic.lower()
    return any(p in low for p in PERMISSIVE) and not any(x in low for x in ("gpl", "mpl", "mozilla", "epl", "cddl"))


def heldout(key, per_10000):
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 10000 < per_10000


def site_dirs():
    cands = [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    try:
        cands += site.getsitepackages()
    except AttributeError:
        pass
    try:
        cands.append(site.getusersitepackages())
    except AttributeError:
        pass
    out = []
    for d in cands:
        if d and os.path.isdir(d) and os.path.realpath(d) not in [os.path.realpath(x) for x in out]:
            out.append(d)
    return out


def candidates(C):
    """(key, abs path, package, version, licence) for every candidate file, and the per-package info."""
    cc = C["corpus"]
    skip_dirs = set(cc["skip_dir_names"])
    files, packages = [], {}
    stdlib = sysconfig.get_paths()["stdlib"]
    pyver = platform.python_version()
    packages["python-stdlib"] = {"version": pyver, "licence": "PSF-2.0", "root": stdlib}
    for dp, dn, fn in os.walk(stdlib):
        dn[:] = sorted(d for d in dn if d not in skip_dirs)
        for f in sorted(fn):
            if f.endswith(".py"):
                p = os.path.join(dp, f)
                files.append(("stdlib/" + os.path.relpath(p, stdlib), p, "python-stdlib"))
    seen_paths = set()
    for sd in site_dirs():
        real_sd = os.path.realpath(sd)
        for dist in sorted(distributions(path=[sd]), key=lambda d: (d.metadata["Name"] or "").lower()):
            name = dist.metadata["Name"] or "unknown"
            if name in packages:          # the same distribution seen through another site dir
                continue
            packages[name] = {"version": dist.version, "licence": licence_of(dist.metadata), "root": sd}
            for rel in dist.files or []:
                s = str(rel)
                if not s.endswith(".py"):
                    continue
                p = os.path.realpath(dist.locate_file(rel))
                if not p.startswith(real_sd + os.sep) or p in seen_paths or not os.path.isfile(p):
                    continue
                parts = os.path.relpath(p, real_sd).split(os.sep)
                if any(x in skip_dirs for x in parts[:-1]):
                    continue
                seen_paths.add(p)
                files.append(("site-packages/" + "/".join(parts), p, name))
    return files, packages


def main():
    a = config.stage_args(training=False)
    C = config.get(a.smoke)
    cc = C["corpus"]
    t0 = time.time()
    out = os.path.join(a.work, "corpus")
    os.makedirs(out, exist_ok=True)
    files, packages = candidates(C)
    # a deterministic order that does not favour any package, for the byte cap
    files.sort(key=lambda f: hashlib.sha1(f[0].encode()).hexdigest())
    skipped = {}
    seen = set()
    used = []
    total = 0

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    with open(os.path.join(out, "docs.jsonl"), "w", encoding="utf-8") as fo:
        for key, path, pkg in files:
            try:
                size = os.path.getsize(path)
            except OSError:
                skip("unreadable")
                continue
            if size < cc["min_file_bytes"]:
                skip("too small")
                continue
            if size > cc["max_file_bytes"]:
                skip("too large")
                continue
            if total + size > cc["max_total_bytes"]:
                skip("over the byte cap")
                continue
            with open(path, "rb") as f:
                raw = f.read()
            h = hashlib.sha1(raw).hexdigest()
            if h in seen:
                skip("duplicate")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                skip("not utf-8")
                continue
            if "\x00" in text:
                skip("binary")
                continue
            long_chars = sum(len(l) for l in text.split("\n") if len(l) > cc["long_line"])
            if long_chars > cc["long_line_frac"] * len(text):
                skip("long lines (generated)")
                continue
            seen.add(h)
            split = "val" if heldout(key, cc["heldout_per_10000"]) else "train"
            fo.write(json.dumps({"key": key, "pkg": pkg, "split": split, "text": text}, ensure_ascii=False) + "\n")
            used.append([key, pkg, split, len(raw), h[:12]])
            total += size
    for p in packages.values():
        p.update(files_train=0, files_val=0, bytes=0)
    for key, pkg, split, n, _ in used:
        packages[pkg]["files_" + split] += 1
        packages[pkg]["bytes"] += n
    packages = {k: v for k, v in sorted(packages.items()) if v["bytes"]}
    for v in packages.values():
        v["permissive"] = is_permissive(v["licence"])
    used.sort()
    stats = {s: {"files": sum(1 for u in used if u[2] == s), "bytes": sum(u[3] for u in used if u[2] == s)}
             for s in ("train", "val")}
    manifest = {
        "what": "Python source files used to train the tiny Laguna (and its tokenizer and drafter)",
        "python": sys.version, "platform": platform.platform(), "stdlib": sysconfig.get_paths()["stdlib"],
        "site_dirs": site_dirs(), "selection": cc, "seed": C["seed"], "splits": stats, "skipped": skipped,
        "packages": packages,
        "files_columns": ["key", "package", "split", "bytes", "sha1[:12]"], "files": used,
    }
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=0, ensure_ascii=False)
    print(f"corpus: {len(used)} files, {total / 1e6:.1f} MB from {len(packages)} packages "
          f"(train {stats['train']['files']} files {stats['train']['bytes'] / 1e6:.1f} MB, "
          f"val {stats['val']['files']} files {stats['val']['bytes'] / 1e6:.2f} MB); skipped {skipped}; "
          f"{time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
