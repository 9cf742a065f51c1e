"""Tests of buffer/."""
