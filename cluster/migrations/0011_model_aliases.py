from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('cluster', '0010_answer_caps'),
    ]

    operations = [
        migrations.AddField(
            model_name='model',
            name='aliases',
            field=models.JSONField(blank=True, default=list),
        ),
    ]
