"""emitters of the amp-rewrite pipeline."""
