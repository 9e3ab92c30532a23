"""`twinspark eval`: quality through the HTTP API — perplexity of a text and the KL divergence of one served model
against another, from prompt logprobs (docs/evaluation.md)."""
