# Rendered by `moe-mesh deploy render --target nomad` from a deploy plan. Do not edit: change the plan
# and render again.
nomad {
  address = "http://127.0.0.1:4646"
}

apm "prometheus" {
  driver = "prometheus"
  config = {
    address = "http://127.0.0.1:9090"
  }
}

strategy "target-value" {
  driver = "target-value"
}
