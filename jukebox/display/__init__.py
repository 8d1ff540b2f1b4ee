"""Text for a person: names made safe to show, colour, tables, progress."""
