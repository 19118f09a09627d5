package chat

import "strconv"

// deepseekDSML: DeepSeek V3.2's <｜DSML｜function_calls> XML, each parameter tagged
// string="true|false" (text, or a JSON value).
type deepseekDSML struct{}

func (deepseekDSML) format() Format                       { return FormatDeepSeekDSML }
func (deepseekDSML) detect(has func(...string) bool) bool { return has("DSML") }
func (deepseekDSML) markers() *markers                    { return deepseekDSMLMarkers }

var deepseekDSMLMarkers = &markers{triggers: []string{"<｜DSML｜function_calls>"}}

func (deepseekDSML) parse(ps *parser, text string) Parsed {
	return ps.section(text, "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", "<｜DSML｜invoke ", "</｜DSML｜invoke>", ps.xmlInvoke("｜DSML｜"))
}

func (deepseekDSML) grammar(r *callRules) ([]Trigger, bool, error) {
	return r.xmlFamily(deepseekDSMLForm)
}

var deepseekDSMLForm = xmlForm{word: "<｜DSML｜function_calls>", open: `"<｜DSML｜function_calls>" "\n"?`, close: `"\n"? "</｜DSML｜function_calls>"`,
	call: func(n string) string { return `<｜DSML｜invoke name="` + n + `">` }, afterName: `"\n"?`, callClose: "</｜DSML｜invoke>",
	param: func(k string, str bool) string {
		return `<｜DSML｜parameter name="` + k + `" string="` + strconv.FormatBool(str) + `">`
	},
	valueEnd: "</｜DSML｜parameter>", stops: []string{"</｜DSML｜invoke>", "</｜DSML｜function_calls>"}, strip: true, attributes: true}
