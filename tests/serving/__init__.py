"""Tests of serving/."""
