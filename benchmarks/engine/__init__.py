"""Whole engine steps in one process: speed against a roofline, configurations, A/B runs."""
