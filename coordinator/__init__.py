"""The syncer shard: fragment plan, ownership, quorum, merge, outer optimizer."""
