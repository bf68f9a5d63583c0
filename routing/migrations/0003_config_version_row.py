from django.db import migrations


def create_row(apps, schema_editor):
    ConfigVersion = apps.get_model("routing", "ConfigVersion")
    ConfigVersion.objects.get_or_create(pk=1)


class Migration(migrations.Migration):
    dependencies = [("routing", "0002_config_version")]

    operations = [migrations.RunPython(create_row, migrations.RunPython.noop)]
