# HTTP/1.1 over bash's /dev/tcp, for scripts that must also run where curl is not
# installed (the GPU machine's image is not ours, and nothing can be installed there).
# Only what the benchmark scripts need: a GET that tells whether a loopback server
# answers 200, and a POST of a JSON file whose reply body goes to a file. Connection:
# close, so the reply ends at EOF; a chunked reply is de-chunked.
#
#   . scripts/http.sh
#   http_ok PORT PATH                         # exit status 0 when the reply is 200
#   http_post PORT PATH BODY_FILE OUT_FILE    # prints the status code

# http_request PORT METHOD PATH [BODY_FILE]: the raw reply on stdout.
http_request() {
	local port=$1 method=$2 path=$3 body=${4:-} len=0
	[ -n "$body" ] && len=$(stat -c %s "$body")
	exec {fd}<>"/dev/tcp/127.0.0.1/$port" || return 1
	{
		printf '%s %s HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n' "$method" "$path" "$port"
		[ -n "$body" ] && printf 'Content-Type: application/json\r\nContent-Length: %d\r\n' "$len"
		printf '\r\n'
		[ -n "$body" ] && cat "$body"
	} >&"$fd"
	cat <&"$fd"
	exec {fd}>&-
}

http_ok() {
	local status
	status=$(http_request "$1" GET "$2" 2>/dev/null | head -1 | cut -d' ' -f2)
	[ "$status" = 200 ]
}

http_post() {
	local raw status
	raw=$(mktemp)
	http_request "$1" POST "$2" "$3" >"$raw" 2>/dev/null
	status=$(head -1 "$raw" | cut -d' ' -f2)
	# The body starts after the first empty line (CRLF CRLF).
	if head -c 4096 "$raw" | tr -d '\r' | sed '/^$/q' | grep -qi '^transfer-encoding: *chunked'; then
		awk 'function hex(s,   i, n) { n = 0; s = tolower(s); sub(/;.*/, "", s)
				for (i = 1; i <= length(s); i++) n = n * 16 + index("0123456789abcdef", substr(s, i, 1)) - 1
				return n }
			BEGIN { RS = "\r\n"; body = 0; want = -1 }
			!body { if ($0 == "") body = 1; next }
			want < 0 { want = hex($0); if (want == 0) exit; next }
			{ printf "%s", $0; want -= length($0); if (want > 0) { printf "\r\n"; want -= 2 } else want = -1 }' "$raw" >"$4"
	else
		awk 'BEGIN { RS = "\r\n"; ORS = "\r\n" } body { print; next } $0 == "" { body = 1 }' "$raw" >"$4"
	fi
	rm -f "$raw"
	echo "${status:-000}"
}
