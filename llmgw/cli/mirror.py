"""`llmgw mirror …`: the model files. On the control plane's host a file is imported by its path; from
anywhere else it is uploaded, with a progress bar."""

from __future__ import annotations

import os
from collections import Counter

from llmgw.cli.client import CliError, bar
from llmgw.cli.output import as_json, size, table


def mirror_import(o, out):
    api, path = o["api"], o["path"]
    if api.local:
        body = {"path": os.path.abspath(os.path.expanduser(path)), **({"name": o["name"]} if o["name"] else {})}
        model_file = api.post("model-files/", body, doing="import model files")
    else:
        if o["name"]:
            raise CliError("--name: an uploaded file keeps its own name; rename the file to list it by another")
        if not os.path.isfile(path):
            raise CliError(f"no such file: {path}" if not os.path.exists(path) else f"not a regular file: {path}")
        model_file = api.upload("model-files/", path, bar(), doing="import model files")
    what = "imported" if api.status == 201 else "already in the mirror"  # 200: the mirror had it
    facts = model_file["gguf"]
    extra = (
        f"; GGUF {facts.get('architecture', '?')}, {facts.get('block_count', '?')} layers, "
        f"context {facts.get('context_length', '?')}"
        if model_file["format"] == "gguf"
        else "; not GGUF"
    )
    out.write(f"{model_file['name']} {what}: sha256 {model_file['sha256']}, {size(model_file['size'])}{extra}\n")


def mirror_list(o, out):
    api = o["api"]
    files = api.rows("model-files/")
    if o.get("json"):
        return as_json(files, out)
    used = Counter(m["file"]["sha256"] for m in api.rows("models/"))
    rows = [[f["sha256"][:12], f["name"], size(f["size"]), f["format"], f["gguf"].get("architecture", "-"),
             used[f["sha256"]], ",".join(c["control_plane"] for c in f.get("locations", [])) or "-"] for f in files]
    table(["SHA256", "NAME", "SIZE", "FORMAT", "ARCH", "MODELS", "ON"], rows, out)
    planes = api.rows("control-planes/")
    if planes:  # each control plane keeps a mirror of its own (docs/high-availability.md)
        out.write("control planes: " + "; ".join(
            f"{p['name']} {p['url'] or '(no URL: the others cannot fetch from it)'}, {p['files']} of {len(files)} "
            f"file(s){'' if p['alive'] else ', not heard from lately'}" for p in planes) + "\n")
