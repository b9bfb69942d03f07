"""`llmgw mirror …`: the model files."""

from __future__ import annotations

from django.db.models import Count

from cluster import operations
from cluster.models import ModelFile
from llmgw.cli.args import CLI_ACTOR
from llmgw.cli.output import as_json, size, table

def mirror_import(o, out):
    model_file, created = operations.import_model_file(o["path"], CLI_ACTOR, name=o["name"])
    what = "imported" if created else "already in the mirror"
    facts = model_file.gguf
    extra = (
        f"; GGUF {facts.get('architecture', '?')}, {facts.get('block_count', '?')} layers, "
        f"context {facts.get('context_length', '?')}"
        if model_file.format == "gguf"
        else "; not GGUF"
    )
    out.write(f"{model_file.name} {what}: sha256 {model_file.sha256}, {size(model_file.size)}{extra}\n")


def mirror_list(o, out):
    files = ModelFile.objects.annotate(used_by=Count("models"))
    if o.get("json"):
        return as_json(
            [{"sha256": f.sha256, "name": f.name, "size": f.size, "format": f.format, "gguf": f.gguf} for f in files],
            out,
        )
    rows = [
        [f.sha256[:12], f.name, size(f.size), f.format, f.gguf.get("architecture", "-"), f.used_by] for f in files
    ]
    table(["SHA256", "NAME", "SIZE", "FORMAT", "ARCH", "MODELS"], rows, out)
