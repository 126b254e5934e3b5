"""The training profiles ``medusa-bench train --profile`` names and the bench's ``--retrain`` uses (its cache
key reads them too): prompts, reply length, epochs, learning rate, draft vocabulary and conditioning."""

TRAIN_PROFILES = {
    # prompts, reply tokens, epochs: 'quick' fits in 15 minutes on a 2-core CPU, data generation included;
    # its 180 steps take a higher peak learning rate than Medusa's 1e-3 (measured on the built-in validation
    # prompts: head 0 top-1 0.276 at 1e-3, 0.294 at 2e-3, 0.300 at 3e-3)
    "quick": {"prompts": 360, "max_new_tokens": 128, "epochs": 6.0, "follow_ups": False, "vocab": "replies",
              "lr": 3e-3, "condition": "path"},
    # 'release' makes the shipped heads; 3e-3 measured better than 1e-3 on MT-Bench (head 0 top-1 0.274 vs 0.262)
    "release": {"prompts": 0, "max_new_tokens": 256, "epochs": 4.0, "follow_ups": True, "vocab": "replies",
                "lr": 3e-3, "condition": "path"},
}
