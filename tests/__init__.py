"""The test suite, grouped by package; shared helpers and fixtures live at this level."""
