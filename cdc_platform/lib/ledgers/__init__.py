"""Ledgers: small Delta tables of facts about landing files (applied, un-applied, set aside)."""
