# Sourced by tracing_cost.sh and tracing_instructions.sh: the `kvroute serve` config both
# measure, so that their figures are for the same proxy.
#
# traced_serve_config FILE LISTEN_PORT UPSTREAM_PORT SAMPLING|off SINK_PORT
# writes one model in kv mode in front of four upstreams on UPSTREAM_PORT..+3, with
# `[tracing]` exporting every second to the OTLP sink at SINK_PORT unless SAMPLING is off.
traced_serve_config() {
    local file=$1 port=$2 ups=$3 sampling=$4 sink=$5
    printf 'listen = "127.0.0.1:%d"\nseed = 1\n[[models]]\nname = "m"\nblock_size = 16\n[health_check]\ninterval_ms = 0\n' \
        "$port" >"$file"
    for i in 0 1 2 3; do
        printf '[[workers]]\nid = %d\nurl = "http://127.0.0.1:%d"\nmodel = "m"\n' "$i" $((ups + i)) >>"$file"
    done
    if [ "$sampling" != off ]; then
        printf '[tracing]\notlp_endpoint = "http://127.0.0.1:%d"\nsampling_ratio = %s\nexport_interval_ms = 1000\n' \
            "$sink" "$sampling" >>"$file"
    fi
}
