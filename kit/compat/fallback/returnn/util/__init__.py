"""``returnn.util``: only ``basic`` is provided."""
