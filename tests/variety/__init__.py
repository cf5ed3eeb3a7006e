"""Config variety, owned by the tests: a seeded generator of varied configs for every family (`draw`), a checker
that reads what a model is made of from its own module tree and config, sharing no reading with the matchers
(`structure`), and the run of one draw through onboard as a user's checkpoint goes (`check`)."""
