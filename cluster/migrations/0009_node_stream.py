from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("cluster", "0008_name_rule"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="stream",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
    ]
