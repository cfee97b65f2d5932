"""Independent reference harness around the transformers DeepSeek-V4 port (see NOTES.md)."""
