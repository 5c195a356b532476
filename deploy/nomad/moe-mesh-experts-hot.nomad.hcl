# Rendered by `moe-mesh deploy render --target nomad` from a deploy plan. Do not edit: change the plan
# and render again.
job "moe-mesh-experts-hot" {
  region      = "global"
  type        = "service"
  datacenters = ["dc1"]

  update {
    max_parallel      = 1
    health_check      = "checks"
    min_healthy_time  = "10s"
    healthy_deadline  = "5m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "experts" {
    count = 2

    scaling {
      enabled = true
      min     = 1
      max     = 4

      policy {
        evaluation_interval  = "15s"
        cooldown             = "15s"
        cooldown_on_scale_up = "15s"

        check "token_rows_up" {
          source = "prometheus"
          query  = "clamp_min((sum(rate(moe_expert_batch_tokens_sum{job=\"experts-hot\"}[1m])) or vector(0)) / count(up{job=\"experts-hot\"} == 1), 2000)"
          group  = "token_rows"

          strategy "target-value" {
            target    = 2000
            threshold = 0.1
          }
        }

        check "token_rows_down" {
          source = "prometheus"
          query  = "(clamp_max(max_over_time(((sum(rate(moe_expert_batch_tokens_sum{job=\"experts-hot\"}[1m])) or vector(0)) / count(up{job=\"experts-hot\"} == 1))[300s:15s]), 2000) unless on() (histogram_quantile(0.99, sum by (le) (rate(gen_ai_server_time_per_output_token_seconds_bucket{job=\"gateway\"}[1m]))) > 0.2)) or on() vector(2000)"
          group  = "token_rows"

          strategy "target-value" {
            target    = 2000
            threshold = 0.1
          }
        }
      }
    }

    constraint {
      attribute = "${node.class}"
      operator  = "="
      value     = "expert"
    }

    network {
      port "grpc" {}

      port "metrics" {}
    }

    volume "model" {
      type      = "host"
      source    = "moe-mesh-model"
      read_only = true
    }

    service {
      name     = "moe-mesh-experts-hot"
      port     = "grpc"
      provider = "consul"
      tags     = ["moe-mesh", "expert-group:hot"]

      meta {
        expert_group = "hot"
        experts      = "*:0-3"
        model_id     = "mixtral-small"
        region       = "global"
      }

      check {
        name     = "grpc health"
        type     = "script"
        task     = "serve-expert"
        command  = "moe-mesh"
        args = [
          "probe",
          "127.0.0.1:${NOMAD_PORT_grpc}",
          "--tls-cert",
          "${NOMAD_SECRETS_DIR}/tls-cert.pem",
          "--tls-key",
          "${NOMAD_SECRETS_DIR}/tls-key.pem",
          "--tls-ca",
          "${NOMAD_SECRETS_DIR}/tls-ca.pem",
          "--tls-server-name",
          "moe-mesh",
        ]
        interval = "10s"
        timeout  = "5s"
      }
    }

    service {
      name     = "moe-mesh-experts-hot-metrics"
      port     = "metrics"
      provider = "consul"
      tags     = ["moe-mesh", "prometheus"]

      check {
        name     = "metrics"
        type     = "http"
        port     = "metrics"
        interval = "10s"
        timeout  = "3s"
        path     = "/metrics"
      }
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "15s"
      mode     = "delay"
    }

    task "serve-expert" {
      driver       = "docker"
      kill_signal  = "SIGTERM"
      kill_timeout = "20s"

      config {
        image        = "moe-mesh:0.1.0"
        network_mode = "host"
        args = [
          "serve-expert",
          "--checkpoint",
          "/models/mixtral-small",
          "--model-id",
          "mixtral-small",
          "--experts",
          "*:0-3",
          "--registry",
          "consul",
          "--host",
          "0.0.0.0",
          "--port",
          "${NOMAD_PORT_grpc}",
          "--advertise-host",
          "${NOMAD_IP_grpc}",
          "--region",
          "global",
          "--compute-threads",
          "2",
          "--tls-cert",
          "${NOMAD_SECRETS_DIR}/tls-cert.pem",
          "--tls-key",
          "${NOMAD_SECRETS_DIR}/tls-key.pem",
          "--tls-ca",
          "${NOMAD_SECRETS_DIR}/tls-ca.pem",
          "--tls-server-name",
          "moe-mesh",
          "--metrics-port",
          "${NOMAD_PORT_metrics}",
        ]
      }

      volume_mount {
        volume      = "model"
        destination = "/models/mixtral-small"
        read_only   = true
      }

      env {
        CONSUL_HTTP_ADDR            = "127.0.0.1:8500"
        OTEL_EXPORTER_OTLP_ENDPOINT = ""
        OTEL_RESOURCE_ATTRIBUTES    = "service.namespace=moe-mesh,moe_mesh.component=expert-hot"
        OTEL_TRACES_SAMPLER_ARG     = "0.01"
        CONSUL_HTTP_TOKEN_FILE      = "${NOMAD_SECRETS_DIR}/consul-token"
      }

      resources {
        cpu    = 4000
        memory = 4096
      }

      template {
        data        = "{{ with nomadVar \"nomad/jobs/moe-mesh-experts-hot\" }}{{ .tls_ca }}{{ end }}"
        destination = "secrets/tls-ca.pem"
        perms       = "0400"
        uid         = 10001
        gid         = 10001
        change_mode = "restart"
      }

      template {
        data        = "{{ with nomadVar \"nomad/jobs/moe-mesh-experts-hot\" }}{{ .expert_tls_cert }}{{ end }}"
        destination = "secrets/tls-cert.pem"
        perms       = "0400"
        uid         = 10001
        gid         = 10001
        change_mode = "restart"
      }

      template {
        data        = "{{ with nomadVar \"nomad/jobs/moe-mesh-experts-hot\" }}{{ .expert_tls_key }}{{ end }}"
        destination = "secrets/tls-key.pem"
        perms       = "0400"
        uid         = 10001
        gid         = 10001
        change_mode = "restart"
      }

      template {
        data        = "{{ with nomadVar \"nomad/jobs/moe-mesh-experts-hot\" }}{{ .consul_token }}{{ end }}"
        destination = "secrets/consul-token"
        perms       = "0400"
        uid         = 10001
        gid         = 10001
        change_mode = "restart"
      }
    }
  }
}
