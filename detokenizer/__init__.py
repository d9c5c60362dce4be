"""Token ids to text, incrementally and never splitting a UTF-8 character."""
