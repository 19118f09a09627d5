package chat

// minimax: <minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>
// </invoke></minimax:tool_call>.
type minimax struct{}

func (minimax) format() Format                       { return FormatMiniMax }
func (minimax) detect(has func(...string) bool) bool { return has("<minimax:tool_call>") }
func (minimax) markers() *markers                    { return minimaxMarkers }

var minimaxMarkers = &markers{triggers: []string{"<minimax:tool_call>"}, thinkTags: [][2]string{thinkTag}}

func (minimax) parse(ps *parser, text string) Parsed {
	return ps.section(text, "<minimax:tool_call>", "</minimax:tool_call>", "<invoke ", "</invoke>", ps.xmlInvoke(""))
}

func (minimax) grammar(r *callRules) ([]Trigger, bool, error) { return r.xmlFamily(minimaxForm) }

var minimaxForm = xmlForm{word: "<minimax:tool_call>", open: `"<minimax:tool_call>" "\n"?`, close: `"\n"? "</minimax:tool_call>"`,
	call: func(n string) string { return `<invoke name="` + n + `">` }, afterName: `"\n"?`, callClose: "</invoke>",
	param:    func(k string, _ bool) string { return `<parameter name="` + k + `">` },
	valueEnd: "</parameter>", stops: []string{"</invoke>", "</minimax:tool_call>"}, strip: true}
