"""A job's items for people: a filtered, searched, paged table and its export (JSON Lines or CSV)."""

from app.jobs.items.export import ItemExport, item_export
from app.jobs.items.table import MAX_LIMIT, ORDERS, item_query, item_view, items_page

__all__ = ["MAX_LIMIT", "ORDERS", "ItemExport", "item_export", "item_query", "item_view", "items_page"]
