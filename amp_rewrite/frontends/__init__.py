"""frontends of the amp-rewrite pipeline."""
