"""gem_ops' run-page views (tables, markdown images) as Dagster metadata values."""

import dagster as dg

from gem_ops.metadata_views import Markdown, Table


def metadata_value(view: Markdown | Table) -> dg.MetadataValue:
    if isinstance(view, Markdown):
        return dg.MetadataValue.md(view.text)
    return dg.MetadataValue.table(
        records=[dg.TableRecord(record) for record in view.records],
        schema=dg.TableSchema(columns=[dg.TableColumn(name, kind) for name, kind in view.columns]),
    )
