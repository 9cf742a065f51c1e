"""Tests of training/."""
