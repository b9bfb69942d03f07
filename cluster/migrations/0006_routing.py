from django.db import migrations, models

CHOICES = [("prefix", "Prefix"), ("least-inflight", "Least Inflight")]


class Migration(migrations.Migration):
    """Models that existed keep the routing they had (least-inflight); new ones route by prefix."""

    dependencies = [
        ("cluster", "0005_max_tokens"),
    ]

    operations = [
        migrations.AddField(
            model_name="model",
            name="routing",
            field=models.CharField(choices=CHOICES, default="least-inflight", max_length=20),
        ),
        migrations.AlterField(
            model_name="model",
            name="routing",
            field=models.CharField(choices=CHOICES, default="prefix", max_length=20),
        ),
    ]
