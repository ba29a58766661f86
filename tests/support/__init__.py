"""Helpers of the test suite (not collected): fixtures' plain functions, fake engines, worker scripts."""
