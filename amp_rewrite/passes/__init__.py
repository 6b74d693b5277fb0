"""passes of the amp-rewrite pipeline."""
