"""What a new cluster starts with: a `default` profile, the engines llmgw has drivers for, the roles."""

from django.db import migrations

ENGINES = [
    # name, kind, device
    ("xllamacpp", "xllamacpp", "cpu"),
    ("llama.cpp", "llama.cpp", "cpu"),
    ("llama.cpp-gpu", "llama.cpp", "gpu"),
    ("vllm", "vllm", "gpu"),
]


def forwards(apps, schema_editor):
    Profile = apps.get_model("cluster", "Profile")
    EngineVersion = apps.get_model("cluster", "EngineVersion")
    Group = apps.get_model("auth", "Group")
    Profile.objects.get_or_create(name="default", defaults={"context_size": 4096, "parallel": 2})
    for name, kind, device in ENGINES:
        EngineVersion.objects.get_or_create(name=name, defaults={"kind": kind, "device": device})
    for role in ("admin", "operator", "viewer"):
        Group.objects.get_or_create(name=role)


class Migration(migrations.Migration):
    dependencies = [("cluster", "0001_initial"), ("auth", "0012_alter_user_first_name_max_length")]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
